"""FP8 W8A8 GEMV with static per-tensor scales, for decode at batch 1: y = (xq @ W^T) * (scale_a * scale_b).

xq [M, K] and W [N, K] are E4M3 codes (the activation already quantized by the layer). The arithmetic is the FP8
GEMM's (torch._scaled_mm): every code widened to fp32 exactly, every product exact in fp32 (4-bit significands),
products accumulated in fp32, the sum times scale_a * scale_b (their fp32 product) in fp32, rounded once to the
output dtype (bf16 / fp16 / fp32: fp32 with unit scales is the accumulator itself, what the engine's fused q|k|v and
gate|up paths read). Only the order of the fp32 sum differs from cuBLAS's: fixed per configuration (a tree over
each program's accumulators, then the K split's partials in split order), so results are deterministic.

The kernel (_fp8_triton.fp8_gemv) splits K over programs where the shape asks for more programs than output tiles,
and combines the partials in one launch (the last program of a tile sums them). It is used where it was measured
faster than cuBLAS at one row: the table CONFIGS, (N, K) -> launch parameters, from the H200 microbenchmark
(bench/fp8_kernels.py); other shapes and more rows keep torch._scaled_mm. Op: quantlab::fp8_gemv (a torch custom
op: torch.compile traces through it, CUDA graphs capture it). `usable(device)` checks the kernel against the exact
arithmetic once per device before any layer uses it; where Triton does not import or the check fails, the layers
keep torch._scaled_mm and the reason is logged.
"""
from __future__ import annotations

import logging
import math

import torch

from quantlab.engines.kernels.api import failed_rows
from quantlab.engines.kernels.device import allowed, available, first_split, interpreted, pdl_on, sm_count, triton_pdl
from quantlab.engines.kernels.scratch import Scratch

log = logging.getLogger("quantlab")

# (N, K) -> configuration, at one row. From bench/fp8_kernels.py on an H200 (the fastest exact configuration per
# shape where it beat torch._scaled_mm: bench/results/h200-2026-12-02/fp8_kernels2.log); other shapes keep
# torch._scaled_mm. Llama-3.1-8B: o, down, fused q|k|v, fused gate|up.
CONFIGS: dict[tuple[int, int], dict] = {
    (4096, 4096): {"block_n": 8, "block_k": 1024, "split_k": 1, "num_warps": 4, "unroll": True, "num_stages": 2},
    (4096, 14336): {"block_n": 16, "block_k": 1024, "split_k": 1, "num_warps": 8},
    (6144, 4096): {"block_n": 16, "block_k": 512, "split_k": 1, "num_warps": 4, "unroll": True},
    (28672, 4096): {"block_n": 8, "block_k": 1024, "split_k": 1, "num_warps": 4, "unroll": True, "num_stages": 3},
}

_SCRATCH = Scratch(1 << 20, 1 << 14)  # split-K partials and tile counters


def reset_counters() -> None:
    """Zero every device's tile counters (after a launch that may have stopped half way, e.g. in a sweep)."""
    _SCRATCH.reset_counters()


def valid_splits(k: int, block_k: int) -> list[int]:
    """Split counts the kernel takes for K inputs: each split a whole number of BLOCK_K steps."""
    if k % block_k:
        return []
    steps = k // block_k
    return [s for s in range(1, steps + 1) if steps % s == 0]


def default_config(n: int, k: int, device: str = "cuda", block_n: int = 32, block_k: int = 256,
                   num_warps: int = 4) -> dict | None:
    """block_n rows x block_k inputs a step (halved while K does not take it), K split as device.first_split chooses
    (TARGET_WAVES programs per SM); None where K is not a multiple of 16."""
    while block_k > 16 and k % block_k:
        block_k //= 2
    splits = valid_splits(k, block_k)
    if not splits:
        return None
    tiles = -(-n // block_n)
    split = first_split(splits, tiles, sm_count(device))
    return {"block_n": block_n, "block_k": block_k, "split_k": split, "num_warps": num_warps}


def config(n: int, k: int) -> dict | None:
    """The measured configuration for one row of an [N, K] layer (CONFIGS), or None: torch._scaled_mm."""
    cfg = CONFIGS.get((n, k))
    if cfg is not None and cfg["split_k"] in valid_splits(k, cfg["block_k"]):
        return cfg
    return None


def launch(xq: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
           cfg: dict | None = None) -> torch.Tensor:
    """xq [M, K] E4M3, w [N, K] E4M3 (row-major), scale_a / scale_b fp32 scalars -> [M, N] in out_dtype.
    cfg: launch parameters; None: CONFIGS, else the default."""
    import triton

    from quantlab.engines.kernels import _fp8_triton

    m, k = xq.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    cfg = cfg or config(n, k) or default_config(n, k, str(xq.device))
    if cfg is None:
        raise ValueError(f"fp8 GEMV: K={k} is not a multiple of 16")
    xq, w = xq.contiguous(), w.contiguous()
    split = cfg["split_k"]
    grid = (triton.cdiv(n, cfg["block_n"]), split, m)
    ws, cnt = _SCRATCH.get(xq.device, split * m * n if split > 1 else 0, grid[0] * m)
    pdl = not interpreted() and pdl_on(xq.device) and triton_pdl()
    _fp8_triton.fp8_gemv[grid](xq, w, scale_a.float().reshape(()), scale_b.float().reshape(()), y, ws, cnt, n, k,
                               BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], SPLIT_K=split,
                               UNROLL=bool(cfg.get("unroll", False)), PDL=pdl,
                               num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 1),
                               **({"launch_pdl": True} if pdl else {}))
    return y


@torch.library.custom_op("quantlab::fp8_gemv", mutates_args=())
def fp8_gemv(xq: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 GEMV as one opaque op (traced by torch.compile, captured by CUDA graphs)."""
    return launch(xq, w, scale_a, scale_b, out_dtype)


@fp8_gemv.register_fake
def _(xq, w, _scale_a, _scale_b, out_dtype):
    return xq.new_empty(xq.shape[0], w.shape[0], dtype=out_dtype)


def applies(rows: int, n: int, k: int, device: torch.device | str) -> bool:
    """Whether quantlab::fp8_gemv multiplies `rows` rows of an [N, K] layer on `device`: one row, a measured
    configuration for the shape, the kernel usable there, and engine.kernels not disabling it (fp8_gemv)."""
    return rows == 1 and allowed("fp8_gemv") and config(n, k) is not None and usable(str(device))


# ------------------------------------------------------------------------------------------------ checks
def codes(shape: tuple, g: torch.Generator, spread: float = 1.0) -> torch.Tensor:
    """Random E4M3 codes of every magnitude (a value quantized with saturation; never NaN)."""
    d = g.device
    v = torch.randn(shape, generator=g, device=d) * torch.exp2(torch.randint(-6, 6, shape, generator=g,
                                                                          device=d).float()) * spread
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def bound(xq: torch.Tensor, w: torch.Tensor, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact result, error bound) of (xq @ w^T) * scale: fp32 accumulation of exact products in any order (a
    statistical bound: sqrt(K) roundings of the running sum's size), the fp32 scaling's rounding, half an ulp of
    the output."""
    x64, w64 = xq.double(), w.double()
    exact = (x64 @ w64.t()) * scale
    eps32 = torch.finfo(torch.float32).eps
    acc = (x64.abs() @ w64.abs().t()) * 2 * math.sqrt(w.shape[1]) * eps32 * scale
    out = (exact.abs() + acc) * (eps32 / 2 + torch.finfo(dtype).eps / 2) * (1 + 1e-6)
    return exact, acc + out + 1e-30


CHECK_CASES = ((1, 64, 512), (1, 40, 256), (3, 32, 384), (1, 96, 1024))


def check_configs(n: int, k: int, device: str) -> list[tuple[str, dict]]:
    """The configurations check() runs on an [N, K] case: no split, a split, wide and narrow tiles."""
    out = []
    for name, block_n, block_k, split_at in (("n32_k128_nosplit", 32, 128, 0), ("n16_k64_split", 16, 64, 1),
                                             ("n64_k32_split_max", 64, 32, -1), ("n32_k64_unrolled", 32, 64, 1)):
        splits = valid_splits(k, block_k)
        if splits:
            out.append((name, {"block_n": block_n, "block_k": block_k, "split_k": splits[split_at],
                               "num_warps": 4, "unroll": name.endswith("unrolled")}))
    default = default_config(n, k, device)
    if default is not None:
        out.append(("default", default))
    return out


def check(device: str = "cpu", dtypes=(torch.float16, torch.float32), cases=CHECK_CASES, seed: int = 0,
          configs=None) -> list[dict]:
    """The kernel against the exact arithmetic (float64) it implements, case by case (rows, N, K) and
    configuration: `worst` is the largest error over its bound (fp32 accumulation, fp32 scaling, half an ulp of
    the output); at most 1 passes (inf: the launch failed, `error` says why). A wrong code, row or scale is off by
    the size of the products, orders of magnitude above the bound. On CUDA devices also `vs_scaled_mm`: the
    largest difference from torch._scaled_mm's output in units of its bound (informational). configs(n, k) ->
    [(name, cfg)]; default check_configs."""
    out = []
    g = torch.Generator().manual_seed(seed)
    for rows, n, k in cases:
        xq, w = codes((rows, k), g), codes((n, k), g, 0.25)
        sa, sb = torch.rand((), generator=g) * 0.02 + 1e-3, torch.rand((), generator=g) * 0.01 + 1e-4
        scale = float(sa.float() * sb.float())
        args = [t.to(device) for t in (xq, w, sa, sb)]
        for dtype in dtypes:
            unit = dtype == torch.float32  # fp32 out: as the fused q|k|v and gate|up paths call it (unit scales)
            one = torch.ones((), device=device)
            case_args = (args[0], args[1], one, one) if unit else tuple(args)
            exact, bnd = bound(xq, w, 1.0 if unit else scale, dtype)
            for name, cfg in (configs or check_configs)(n, k, device):
                row = {"rows": rows, "n": n, "k": k, "kernel": name, "dtype": str(dtype).removeprefix("torch."),
                       "unit_scales": unit, "worst": float("inf"), "ok": False}
                y = _SCRATCH.check_case(row, lambda a=case_args, c=cfg, d=dtype: launch(*a, d, cfg=c), exact, bnd,
                                        (rows, n), dtype)
                if device.startswith("cuda") and y is not None and n % 16 == 0:
                    ref = torch._scaled_mm(torch.nn.functional.pad(case_args[0], (0, 0, 0, (-rows) % 16)),
                                           case_args[1].t(), scale_a=case_args[2], scale_b=case_args[3],
                                           out_dtype=dtype)[:rows].cpu()
                    row["vs_scaled_mm"] = float(((y.double() - ref.double()).abs() / bnd).max())
                    row["scaled_mm_worst"] = float(((ref.double() - exact).abs() / bnd).max())
                out.append(row)
    return out


SELF_CHECK_CASES = ((1, 96, 512), (1, 40, 256))
_USABLE: dict = {}


def usable(device: str) -> bool:
    """Whether the kernel computes exactly on this device: check() on small cases, once per process (False where
    Triton cannot run; the reason is logged once)."""
    device = str(device)
    if device not in _USABLE:
        why = None
        if not available():
            why = "Triton does not import"
        elif not device.startswith("cuda") and not interpreted():
            why = "not a CUDA device"
        else:
            dtypes = (torch.bfloat16, torch.float32) if device.startswith("cuda") else (torch.float16, torch.float32)
            bad = failed_rows(lambda: check(device, dtypes=dtypes, cases=SELF_CHECK_CASES))
            if bad:
                why = f"the kernel failed its check ({bad[:2]})"
        if why is not None:
            log.warning("fp8: the one-row FP8 GEMV is not used on %s: %s; torch._scaled_mm serves every shape",
                        device, why)
        _USABLE[device] = why is None
    return _USABLE[device]
