"""W4A16 GEMM on weights that stay packed: y = (x * pre_quant_scale) @ dequant(W)^T.

The layout is the export's own, read as is: int4 codes packed two per byte along the output dimension (uint8
[N/2, K]: row 2r in the low nibble, row 2r+1 in the high nibble, two's complement) and one scale per group of
`group` inputs ([N, K/group], in the compute dtype). The arithmetic is the dequantized layer's (qlayers.Int4AwqLinear
on the CPU), value for value: the input times pre_quant_scale rounded to the compute dtype, each weight
q * scale computed exactly in fp32 and rounded once to the compute dtype, products accumulated in fp32, the output
rounded to the compute dtype. Only the order of the fp32 accumulation differs from a dequantize-then-GEMM.

K is a compile-time constant (a model has two or three input widths; a loop bound known to the compiler, and what
Triton's CPU interpreter needs under NumPy 2.4). Two kernels: a GEMV for one row (decode at batch 1: each weight
byte is read once and used once, so the product is an FMA and the tile stays in the layout it was loaded in) and a
tensor-core GEMM (tl.dot) for more rows. Both are registered as one torch custom op (quantlab::w4a16_mm) so
torch.compile traces through it and CUDA graphs capture it. Nothing is dequantized into memory: a layer holds
N*K/2 bytes of codes and N*K/group scales.
"""
from __future__ import annotations

import functools
import math
import os

import torch

GEMV_MAX_ROWS = 1  # rows handled by the GEMV kernel; more rows use the tensor-core GEMM
GEMV_ASM = False  # the GEMV dequantizes with packed PTX (bf16 / fp16 on GPUs); off until a GPU run validated it


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
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernels():
    import triton

    from quantlab.engines.kernels import _int4_triton

    return triton, _int4_triton.w4a16_gemv, _int4_triton.w4a16_gemm


def _pow2_at_most(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def gemv_config(n: int, k: int, group: int) -> dict:
    """Launch parameters of the GEMV (chosen by shape; bench/decode.py --check times the alternatives)."""
    groups = _pow2_at_most(max(1, 256 // group), k // group)  # 256 inputs a step: 16 fp32 accumulators a thread
    return {"GROUPS": groups, "BLOCK_N2": 8, "num_warps": 4}


def gemm_config(m: int, n: int, k: int, group: int) -> dict:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_k = _pow2_at_most(group, 64 if block_m >= 64 else 128)
    return {"BLOCK_M": block_m, "BLOCK_N2": 32 if block_m <= 32 else 64, "BLOCK_K": block_k,
            "num_warps": 4 if block_m <= 64 else 8, "num_stages": 3}


def w4a16_launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, pqs: torch.Tensor | None,
                 group: int, config: dict | None = None, gemv: bool | None = None,
                 asm: bool | None = None) -> torch.Tensor:
    """x [M, K] (compute dtype), packed uint8 [N/2, K], scales [N, K/group] -> y [M, N] in x's dtype."""
    triton, gemv_kernel, gemm_kernel = _kernels()
    m, k = x.shape
    n2 = packed.shape[0]
    x = x.contiguous()
    y = torch.empty(m, 2 * n2, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    p = pqs if pqs is not None else scales  # any pointer: unused when HAS_PQS is False
    if gemv if gemv is not None else m <= GEMV_MAX_ROWS:
        cfg = config or gemv_config(2 * n2, k, group)
        meta = {key: v for key, v in cfg.items() if key not in ("num_warps", "num_stages")}
        grid = (triton.cdiv(n2, meta["BLOCK_N2"]), m)
        use_asm = (GEMV_ASM if asm is None else asm) and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
        gemv_kernel[grid](x, packed, scales, p, y, n2, k, x.stride(0), y.stride(0), scales.stride(0),
                          GROUP=group, KSTEP=meta["GROUPS"] * group, HAS_PQS=pqs is not None, ASM=use_asm,
                          num_warps=cfg.get("num_warps", 4), **meta)
    else:
        cfg = config or gemm_config(m, 2 * n2, k, group)
        meta = {key: v for key, v in cfg.items() if key not in ("num_warps", "num_stages")}
        grid = (triton.cdiv(n2, meta["BLOCK_N2"]), triton.cdiv(m, meta["BLOCK_M"]))
        gemm_kernel[grid](x, packed, scales, p, y, m, n2, k, x.stride(0), y.stride(0), scales.stride(0),
                          GROUP=group, HAS_PQS=pqs is not None, F32_DOT=x.dtype == torch.float32 or interpreted(),
                          num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), **meta)
    return y


@torch.library.custom_op("quantlab::w4a16_mm", mutates_args=())
def w4a16_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, pqs: torch.Tensor | None,
             group: int) -> torch.Tensor:
    """The packed W4A16 GEMM as one opaque op (traced by torch.compile, captured by CUDA graphs)."""
    return w4a16_launch(x, packed, scales, pqs, group)


@w4a16_mm.register_fake
def _(x, packed, scales, pqs, group):
    return x.new_empty(x.shape[0], 2 * packed.shape[0])


def reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, pqs: torch.Tensor | None,
              group: int) -> torch.Tensor:
    """The same arithmetic in plain torch: dequantize (q * scale in fp32, rounded to the compute dtype), GEMM."""
    from quantlab.engines.qlayers import unpack_int4

    dtype = x.dtype
    if pqs is not None:
        x = x * pqs
    w = (unpack_int4(packed).float() * scales.float().repeat_interleave(group, dim=1)).to(dtype)
    return x @ w.t()


CHECK_CASES = ((1, 64, 256, 64, True), (1, 48, 128, 32, False), (3, 64, 384, 128, True), (20, 96, 256, 64, False))


def check(device: str = "cpu", dtypes=(torch.float16, torch.float32), cases=CHECK_CASES, seed: int = 0) -> list[dict]:
    """Both kernels against the exact arithmetic they implement, case by case (rows, N, K, group, with
    pre_quant_scale): the input times pre_quant_scale rounded to the compute dtype, weights q * scale rounded once,
    exact products accumulated in fp32 in any order, the output rounded once. `worst` is the largest error over
    its bound (fp32 accumulation of |x||w| plus half an ulp of the output): at most 1 passes. A wrong code, scale
    or group is off by the size of the products, orders of magnitude above the bound. Used by the tests
    (Triton's CPU interpreter) and by bench/decode.py --check (on the GPU, at the model's shapes)."""
    from quantlab.engines.qlayers import unpack_int4

    out = []
    g = torch.Generator().manual_seed(seed)
    for rows, n, k, group, has_pqs in cases:
        packed = torch.randint(0, 256, (n // 2, k), generator=g, dtype=torch.uint8)
        for dtype in dtypes:
            scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(dtype)
            pqs = (torch.rand(k, generator=g) + 0.5).to(dtype) if has_pqs else None
            x = torch.randn(rows, k, generator=g).to(dtype)
            xs = x * pqs if has_pqs else x
            w = (unpack_int4(packed).float() * scales.float().repeat_interleave(group, 1)).to(dtype)
            exact = xs.double() @ w.double().t()
            # fp32 accumulation in any order (a statistical bound: sqrt(K) roundings), then one rounding
            accumulation = (xs.double().abs() @ w.double().abs().t()) * 2 * math.sqrt(k) * torch.finfo(
                torch.float32).eps
            bound = accumulation + (exact.abs() + accumulation) * torch.finfo(dtype).eps / 2 * (1 + 1e-6) + 1e-30
            args = [t.to(device) if t is not None else None for t in (x, packed, scales, pqs)]
            variants = [("gemv", True, False), ("gemm", False, False)]
            if device != "cpu" and dtype != torch.float32:
                variants.append(("gemv_asm", True, True))
            for kernel, gemv, asm in variants:
                try:
                    y = w4a16_launch(*args, group, gemv=gemv, asm=asm).cpu()
                except Exception as exc:  # noqa: BLE001 - reported as a failed case
                    out.append({"rows": rows, "n": n, "k": k, "group": group, "pqs": has_pqs, "kernel": kernel,
                                "dtype": str(dtype).removeprefix("torch."), "ok": False, "error": str(exc)[:300]})
                    continue
                ok_shape = y.dtype == dtype and tuple(y.shape) == (rows, n)
                worst = float(((y.double() - exact).abs() / bound).max()) if ok_shape else float("inf")
                out.append({"rows": rows, "n": n, "k": k, "group": group, "pqs": has_pqs,
                            "dtype": str(dtype).removeprefix("torch."), "kernel": kernel,
                            "worst": worst, "ok": ok_shape and worst <= 1.0})
    return out
