"""What every kernel asks of the device it runs on, in one place: compute capability, SM count, whether Triton runs
(or its CPU interpreter), launch geometry, and whether kernels launch as programmatic dependents (PDL).

The engine's kernel switches (`engine.kernels`, quantlab.engines.registry.KernelsConfig) arrive here as a
KernelContext: `configure(ctx)` is called when the torch engine is built, and `current()` is what the launchers, the
layers' kernel choice and the decoder read. Launches happen inside torch custom ops, whose arguments are tensors and
numbers, so the context is held for the process (one engine's build sets it; the next build sets it again).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

from quantlab.engines.kernels.names import ALL

TARGET_WAVES = 4  # split-K defaults: split K until the grid holds this many programs per SM


@dataclass(frozen=True)
class KernelContext:
    """The kernel switches as the kernels read them: names disabled (names.KERNELS, or names.ALL), programmatic
    dependent launch, the decode step's edges compiled with its layers, and inductor's horizontal fusion."""

    disabled: frozenset = field(default_factory=frozenset)
    pdl: bool = True
    compile_edges: bool = True
    combo_kernels: bool = True

    def allows(self, name: str) -> bool:
        """Whether kernel `name` may run (not disabled by name, nor by `all`)."""
        return ALL not in self.disabled and name not in self.disabled

    def describe(self) -> dict:
        """The switches as plain values (run.json, the engine's plan)."""
        return {"disabled": sorted(self.disabled), "pdl": self.pdl, "compile_edges": self.compile_edges,
                "combo_kernels": self.combo_kernels}


_CURRENT = [KernelContext()]


def configure(ctx: KernelContext) -> None:
    """Make ctx the switches every kernel reads from now on (the torch engine's build calls it)."""
    _CURRENT[0] = ctx


def current() -> KernelContext:
    """The switches in force (the defaults until an engine is built)."""
    return _CURRENT[0]


def allowed(name: str) -> bool:
    """current().allows(name)."""
    return _CURRENT[0].allows(name)


@functools.cache
def available() -> bool:
    """Triton imports (on CUDA builds of torch it does; the interpreter runs it on the CPU for tests)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no kernel here
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1: the tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device | str) -> tuple[int, int]:
    """A CUDA device's compute capability (the current device where it names none), queried once per device."""
    dev = torch.device(device)
    return _capability_of(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.cache
def sm_count(device: str) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: the interpreter's grids stay small)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 4


def first_split(splits: list[int], tiles: int, sms: int) -> int:
    """The smallest of a kernel's valid splits (ascending) that gives `tiles` output tiles TARGET_WAVES programs per
    SM, else the largest (the k8 kernels' and the FP8 GEMV's default)."""
    return next((s for s in splits if tiles * s >= TARGET_WAVES * sms), splits[-1])


PDL_REFUSED: list[str] = []  # the driver's refusal of a programmatic launch, once: every later launch is plain


def pdl_on(device: torch.device | str) -> bool:
    """Whether kernels on this device are launched as programmatic dependents (PDL): the switch on
    (engine.kernels.pdl), compute capability 9.0+, and the driver has not refused one."""
    dev = torch.device(device)
    if dev.type != "cuda" or PDL_REFUSED or not current().pdl:
        return False
    return capability(dev)[0] >= 9


@functools.cache
def triton_pdl() -> bool:
    """Whether this Triton has the grid-dependency intrinsics the Triton kernels use under PDL."""
    try:
        from triton.language.extra import cuda as triton_cuda
    except ImportError:
        return False
    return hasattr(triton_cuda, "gdc_wait") and hasattr(triton_cuda, "gdc_launch_dependents")
