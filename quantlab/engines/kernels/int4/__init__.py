"""W4A16 GEMM on weights that stay packed: y = (x * pre_quant_scale) @ dequant(W)^T.

The arithmetic is the dequantized layer's (qlayers.Int4AwqLinear on the CPU), value for value: the input times
pre_quant_scale rounded to the compute dtype, each weight q * scale computed exactly in fp32 and rounded once to the
compute dtype, products accumulated in fp32, the output rounded to the compute dtype. Only the order of the fp32
accumulation differs from a dequantize-then-GEMM.

Two layouts, two kernel families (and, for the k8 layout at up to 8 rows on CUDA devices, a CUDA C++ kernel on
tensor cores compiled at run time by NVRTC: see "k8 on tensor cores" below and _int4_cuda; decode at batch 1 takes
it where it compiles and passes its check, else the Triton one-row kernel):
- k8 (what the engine runs): `repack` rewrites the export's codes once at load into int32 [N, K/8], 8 codes of one
  output row per word along K (offset binary; within each block of 128 inputs, nibble j of word i is input 128b + 16j
  + i), stored in tiles of 16 rows: the 16 words of block b of rows 16T..16T+15 are one contiguous 1 KB (word offset
  ((T * K/128 + b) * 16 + row % 16) * 16 + i, `k8_offset`), so a warp reading eight rows' block reads 512 contiguous
  bytes; and the scales transposed to [K/group, N] (one coalesced vector per group). `k8_launch` runs, for one row
  (decode at batch 1), the FMA kernel w4a16_k8_gemv (split over K like the next one; on the GPU in bf16 / fp16 each
  pair of weights is dequantized by a short PTX block: the two codes moved into one register's 16-bit halves with a
  LOP3 and the magic-number trick, u - 8 by a packed FMA (exact), times the two scales by a packed FMA (RN: the one
  rounding of q * scale to the compute dtype), each half widened exactly to fp32 for the FMAs with x; in Triton's
  interpreter the same values come from Triton arithmetic: the contract above is unchanged); up to DENSE_ROWS rows,
  one split-K kernel (w4a16_k8: every SM streams codes; partials reduced in fp32 by the last program of each tile, in
  a fixed order) in one of two modes - tensor-core products of dequantized 16-wide tiles (`dot`), or FMAs (one row per
  program) - with a configuration per shape (`k8_config`: the table CONFIGS that bench/decode.py --check's sweep fills
  and prints, else a default); from DENSE_ROWS rows on (prefill) it dequantizes the layer into a temporary and lets
  torch's GEMM multiply. Op: quantlab::w4a16_k8.
- export (the fallback): the export's own layout read as is (uint8 [N/2, K], rows 2r / 2r+1 in the low / high
  nibble, two's complement; scales [N, K/group]): a GEMV for one row and a tensor-core GEMM. Op: quantlab::w4a16_mm.
  Layers keep this layout where the k8 kernels do not apply (N not in tiles of 16, K not a multiple of 128, a group
  size that does not tile 128) or fail their check on the device (`k8_usable`, run once per device and dtype before
  any layer is repacked).

K is a compile-time constant (a model has two or three input widths; loop bounds known to the compiler are what
Triton's CPU interpreter needs under NumPy 2.4). Both ops are torch custom ops, so torch.compile traces through them
and CUDA graphs capture them. A layer holds N*K/2 bytes of codes and N*K/group scales, never dequantized weights.

The package, by job: configs (CONFIGS, defaults, splits, routes, the shapes each kernel takes), layout (the export
and k8 layouts, repack, the gate|up interleave, plain-torch readings), launch (the launchers and their fallbacks),
ops (the five custom ops and their fakes), checks (the kernels against exact arithmetic, startup and first-use
checks, sweep candidates), linear (the priority list the layers choose from, quantlab.engines.kernels.api, and w4a16).
This module re-exports their public names.
"""
from __future__ import annotations

from quantlab.engines.kernels.device import available, interpreted
from quantlab.engines.kernels.int4 import ops  # noqa: F401 - registers the quantlab::w4a16_* ops
from quantlab.engines.kernels.int4.checks import (
    CHECK_CASES,
    MMA_CHECK_CASES,
    MMA_VARIANTS,
    SELF_CHECK_CASES,
    TMA_VARIANTS,
    XP_VARIANTS,
    bound,
    check,
    check_gated,
    check_residual,
    first_use,
    k8_usable,
    k8_variants,
    mma_usable,
    sweep_candidates,
)
from quantlab.engines.kernels.int4.configs import (
    CONFIGS,
    DENSE_ROWS,
    GEMV_MAX_ROWS,
    K8_TILE,
    MMA_ROWS,
    MMA_SHAPES,
    TMA_MAX_SHARED,
    default_split,
    epilogue_cfg,
    gemm_config,
    gemv_config,
    k8_config,
    k8_dot_config,
    k8_gemv_config,
    k8_route,
    k8_supported,
    m_bucket,
    mma_applies,
    mma_config,
    one_row_cfg,
    tma_shape,
    tma_shared,
    valid_splits,
)
from quantlab.engines.kernels.int4.launch import (
    MmaUnavailable,
    k8_kernels,
    k8_launch,
    k8_launch_gated,
    k8_launch_ordered,
    k8_launch_ordered_add,
    k8_mma,
    mma_on,
    mma_ready,
    ordered_on,
    ptx16,
    reset_counters,
    tma_applies,
    w4a16_launch,
)
from quantlab.engines.kernels.int4.layout import (
    deinterleave_gated,
    gated_torch,
    interleave_gated,
    k8_codes,
    k8_dequantized,
    k8_offset,
    reference,
    repack,
)
from quantlab.engines.kernels.int4.ops import w4a16_k8, w4a16_k8_gated, w4a16_k8_ordered, w4a16_k8_ordered_add, w4a16_mm

__all__ = [
    "CHECK_CASES", "CONFIGS", "DENSE_ROWS", "GEMV_MAX_ROWS", "K8_TILE", "MMA_CHECK_CASES", "MMA_ROWS", "MMA_SHAPES",
    "MMA_VARIANTS", "SELF_CHECK_CASES", "TMA_MAX_SHARED", "TMA_VARIANTS", "XP_VARIANTS", "MmaUnavailable",
    "available", "bound", "check", "check_gated", "check_residual", "default_split", "deinterleave_gated",
    "epilogue_cfg", "first_use", "gated_torch", "gemm_config", "gemv_config", "interleave_gated", "interpreted",
    "k8_codes", "k8_config", "k8_dequantized", "k8_dot_config", "k8_gemv_config", "k8_kernels", "k8_launch",
    "k8_launch_gated", "k8_launch_ordered", "k8_launch_ordered_add", "k8_mma", "k8_offset", "k8_route",
    "k8_supported", "k8_usable", "k8_variants", "m_bucket", "mma_applies", "mma_config", "mma_on", "mma_ready",
    "mma_usable", "one_row_cfg", "ordered_on", "ptx16", "reference", "repack", "reset_counters", "sweep_candidates",
    "tma_applies", "tma_shape", "tma_shared", "valid_splits", "w4a16_k8", "w4a16_k8_gated", "w4a16_k8_ordered",
    "w4a16_k8_ordered_add", "w4a16_launch", "w4a16_mm",
]
