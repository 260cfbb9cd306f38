"""The kernel seam: what a layer asks of the kernel wing, and how the kernel wing answers.

A layer describes its product as a LinearSpec (format, N, K, group, compute dtype, pre_quant_scale, bias, device)
and asks `choose(spec, ctx, kernels)` for a kernel: the first of the op's priority list whose `can_implement(spec)`
says yes and that `ctx` (engine.kernels) does not disable. Every refusal's reason is kept on the Choice (the engine's
plan in engine.json, `kernel_choices`). The shape of the seam follows the mixed-precision linear kernels of vLLM
(can_implement, a priority list with its reasons, one disabled list). The INT4 priority list is
quantlab.engines.kernels.int4.linear.PRIORITY; the FP8 GEMV and the decode-attention kernel are single kernels with
a torch fallback (kernels.fp8.applies, kernels.attention.usable), switched by the same engine.kernels.disabled.

Not yet behind the seam: the layers still hold their weights' layout (Int4AwqLinear.layout, `ordered`,
`pqs_in_op`) and call kernels.int4.linear.w4a16, which dispatches on it; a `prepare(weights) -> packed` and
`apply(packed, x, epilogue)` per kernel are the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from quantlab.engines.kernels.device import KernelContext


@dataclass(frozen=True)
class LinearSpec:
    """One quantized product y = x W^T: its format (a kernel family's name: "int4_awq"), N outputs, K inputs, group
    size (0: none), the compute dtype, whether a pre_quant_scale multiplies x, whether a bias is added, the device, and
    `role`: where the layer sits ("linear"; "attention_output": its input comes from an op torch.compile cannot fuse
    into, so pre_quant_scale is best applied inside the kernel)."""

    format: str
    n: int
    k: int
    group: int
    dtype: torch.dtype
    pqs: bool = False
    bias: bool = False
    device: str = "cpu"
    role: str = "linear"


class LinearKernel(Protocol):
    """One kernel of a linear op's priority list."""

    name: str  # as engine.kernels.disabled names it (quantlab.engines.kernels.names.KERNELS), or "torch"
    description: str

    def can_implement(self, spec: LinearSpec) -> tuple[bool, str | None]:
        """(True, None), or (False, why not) for this spec on this machine."""


@dataclass
class Choice:
    """What choose() picked for one spec, and why each kernel before it was refused."""

    kernel: Any
    refused: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict:
        """{"kernel": name, "refused": {name: why}} (the engine's plan)."""
        return {"kernel": self.kernel.name, "refused": dict(self.refused)}


def choose(spec: LinearSpec, ctx: KernelContext, kernels) -> Choice:
    """The first kernel of `kernels` (a priority list ending in a reference that implements everything) that ctx does
    not disable and that can implement spec; the refusals' reasons on the Choice."""
    refused = {}
    for kernel in kernels:
        if kernel.name != "torch" and not ctx.allows(kernel.name):
            refused[kernel.name] = "disabled (engine.kernels.disabled)"
            continue
        ok, why = kernel.can_implement(spec)
        if ok:
            return Choice(kernel, refused)
        refused[kernel.name] = why or "refused"
    raise ValueError(f"no kernel implements {spec} (the priority list must end in the torch reference)")


def failed_rows(run) -> list[dict]:
    """The rows of a kernel check (run()) that did not pass; a check that raises, or that ran no case, is one failed
    row saying why (the startup and first-use checks of the k8 kernels, the tensor-core kernel and the FP8 GEMV)."""
    try:
        rows = run()
    except Exception as exc:  # noqa: BLE001 - the kernel is not used then, and the caller says why
        return [{"error": f"{type(exc).__name__}: {exc}"}]
    if not rows:
        return [{"error": "the check ran no case"}]
    return [r for r in rows if not r["ok"]]
