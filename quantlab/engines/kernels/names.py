"""The names of quantlab's own kernels, as `engine.kernels.disabled` takes them (no torch, no CUDA: the config layer
validates against this table before anything is computed).

`all` disables every one of them: every layer then runs its torch reference (the INT4 layers dequantize their weights
once and multiply with torch's GEMM; FP8 layers keep torch._scaled_mm; attention is the model's own), the numerics the
GPU tests compare each kernel with.
"""
from __future__ import annotations

KERNELS: dict[str, str] = {
    "int4_mma": "W4A16 on tensor cores, up to 8 rows (CUDA C++ compiled by NVRTC; k8 layout)",
    "int4_tma": "the bulk-copy (TMA) variant of int4_mma at one row (compute capability 9.x / 10.x)",
    "int4_k8": "W4A16 Triton kernels on the k8 layout (one-row GEMV, split-K GEMM, dense dequantize + GEMM)",
    "int4_export": "W4A16 Triton kernels on the export's own layout (GEMV and GEMM)",
    "int4_xorder": "one-row INT4 layers handed x in the tensor-core kernel's input order (needs int4_mma)",
    "int4_gated_epilogue": "SiLU * up in the INT4 gate|up kernel's epilogue at one row (needs int4_xorder)",
    "int4_residual_epilogue": "a compiled layer's residual add in its one-row INT4 down projection (needs int4_xorder)",
    "fp8_gemv": "the one-row FP8 GEMV (Triton) where it was measured faster than torch._scaled_mm",
    "decode_attention": "the decode-attention kernel (Triton) on the static KV cache, one token a step",
}
ALL = "all"  # every kernel above: the torch reference numerics
ENV_DISABLED = "QUANTLAB_DISABLED_KERNELS"  # benches only: a comma-separated list added to engine.kernels.disabled
# the environment switches of earlier versions and the engine.kernels override each became: a run with one set is
# refused (exit 2) rather than silently running with the feature on
LEGACY_ENV: dict[str, str] = {
    "QUANTLAB_PDL": "engine.kernels.pdl=false",
    "QUANTLAB_COMPILE_EDGES": "engine.kernels.compile_edges=false",
    "QUANTLAB_COMBO_KERNELS": "engine.kernels.combo_kernels=false",
    "QUANTLAB_INT4_EPILOGUE": "engine.kernels.disabled=[int4_gated_epilogue]",
    "QUANTLAB_INT4_RESIDUAL": "engine.kernels.disabled=[int4_residual_epilogue]",
    "QUANTLAB_INT4_XORDER": "engine.kernels.disabled=[int4_xorder]",
}
