"""The INT4 (W4A16) face of the kernel seam: the priority list of kernels a packed layer can run on, each with its
can_implement(spec) -> (ok, why not), and `w4a16`, the one call the layers make (they know no op name).

Priority (first that can implement the spec and engine.kernels does not disable): int4_tma (the bulk-copy
tensor-core kernel, a configured one-row shape) -> int4_mma (tensor cores, up to 8 rows) -> int4_k8 (Triton on the k8
layout) -> int4_export (Triton on the export's layout) -> torch (dequantized once, torch's GEMM: the reference
numerics, what engine.kernels.disabled=[all] runs). `choose(spec, ctx, PRIORITY)` (kernels.api) gives the chosen
kernel and every refusal's reason; the torch engine's plan records it per layer shape.
"""
from __future__ import annotations

import torch

from quantlab.engines.int4_codes import in_x_order
from quantlab.engines.kernels import device
from quantlab.engines.kernels.api import LinearSpec
from quantlab.engines.kernels.int4 import checks, configs, launch
from quantlab.engines.kernels.int4 import ops as _ops  # noqa: F401 - registers the quantlab::w4a16_* ops


def w4a16(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, pqs: torch.Tensor | None,
          block: int, pqs_in_op: bool = False, ordered: bool = False) -> torch.Tensor:
    """The packed W4A16 GEMM on x [M, K] in the scales' dtype -> [M, N] in that dtype: quantlab::w4a16_k8 on the
    k8 layout (int32 codes), quantlab::w4a16_mm on the export layout (uint8 codes). k8: pre_quant_scale multiplies
    x before the op (torch.compile fuses it into the producer, a norm or the activation), or inside it where
    pqs_in_op (the same product, rounded once to the compute dtype). One row where `ordered` (set at repack where
    the tensor-core kernel runs): x in the kernel's input order (in_x_order: views torch.compile folds into the
    producer) and quantlab::w4a16_k8_ordered (the same sums)."""
    if packed.dtype == torch.int32:
        x = x.to(scales.dtype)
        if pqs is not None and not pqs_in_op:
            x, pqs = x * pqs, None
        if ordered and pqs is None and x.shape[0] == 1:
            return torch.ops.quantlab.w4a16_k8_ordered(in_x_order(x), packed, scales, block)
        return torch.ops.quantlab.w4a16_k8(x, packed, scales, pqs, block)
    return torch.ops.quantlab.w4a16_mm(x.to(scales.dtype), packed, scales, pqs, block)


def _gpu(spec: LinearSpec) -> str | None:
    if not spec.device.startswith("cuda"):
        return f"not a CUDA device ({spec.device})"
    if not device.available():
        return "Triton does not import here"
    return None


class _Kernel:
    name = ""
    description = ""

    def can_implement(self, spec: LinearSpec) -> tuple[bool, str | None]:
        """(True, None), or (False, why not) for this spec on this machine."""
        why = self.refusal(spec)
        return why is None, why

    def refusal(self, spec: LinearSpec) -> str | None:  # pragma: no cover - every kernel below overrides it
        """Why this kernel cannot take spec (None: it can)."""
        raise NotImplementedError


class Int4Tma(_Kernel):
    """The bulk-copy (TMA) variant of the tensor-core kernel, at one row, where CONFIGS names it for the shape."""

    name, description = "int4_tma", "CUDA tensor-core kernel, bulk-copy variant (one row, configured shapes)"

    def refusal(self, spec):
        """A configured one-row TMA shape on compute capability 9.x / 10.x, with the tensor-core kernel itself."""
        cfg = configs.CONFIGS.get((1, spec.n, spec.k))
        if not (cfg and cfg.get("tma")):
            return f"CONFIGS has no bulk-copy entry for one row of [{spec.n}, {spec.k}]"
        why = Int4Mma().refusal(spec)
        if why:
            return why
        if not launch.tma_applies(1, spec.n, spec.k, spec.group, spec.dtype, spec.device, cfg["warps"]):
            return "the shape, group or device does not take the bulk-copy variant (group 128, sm 9.x / 10.x)"
        return None


class Int4Mma(_Kernel):
    """The tensor-core kernel (CUDA C++ compiled by NVRTC), up to MMA_ROWS rows on the k8 layout."""

    name, description = "int4_mma", "CUDA tensor-core kernel (NVRTC; k8 layout, up to 8 rows)"

    def refusal(self, spec):
        """The k8 layout's shapes, a 16-bit dtype, and the kernel's startup check passed on the device."""
        why = _gpu(spec) or Int4K8().refusal(spec)
        if why:
            return why
        if not device.allowed("int4_k8"):
            return "runs on the k8 layout, and int4_k8 is disabled"
        if not configs.mma_applies(1, spec.n, spec.k, spec.group, spec.dtype):
            return f"needs a 16-bit compute dtype (got {spec.dtype})"
        if not launch.mma_on(spec.device, spec.dtype):
            return "compute capability below 8.0, or its startup check failed on this device (see the log)"
        return None


class Int4K8(_Kernel):
    """Triton kernels on the k8 layout (one-row GEMV, split-K GEMM, dense dequantize + torch GEMM)."""

    name, description = "int4_k8", "Triton W4A16 on the k8 layout"

    def refusal(self, spec):
        """N in tiles of 16, K in blocks of 128, a group that tiles 128, on a CUDA device with Triton."""
        why = _gpu(spec)
        if why:
            return why
        if not configs.k8_supported(spec.n, spec.k, spec.group):
            return f"N={spec.n} not in tiles of 16, K={spec.k} not in blocks of 128, or group {spec.group}"
        if not checks.k8_usable(spec.device, spec.dtype):
            return "failed its startup check on this device (see the log)"
        return None


class Int4Export(_Kernel):
    """Triton kernels on the export's own layout (GEMV and GEMM)."""

    name, description = "int4_export", "Triton W4A16 on the export layout"

    def refusal(self, spec):
        """Any shape the export holds, on a CUDA device with Triton."""
        return _gpu(spec)


class Int4Torch(_Kernel):
    """The reference: the weights dequantized once at load, torch's GEMM."""

    name, description = "torch", "dequantized once at load, torch's GEMM (the reference numerics)"

    def refusal(self, _spec):
        """Always takes the spec."""
        return None


PRIORITY = (Int4Tma(), Int4Mma(), Int4K8(), Int4Export(), Int4Torch())
