"""FP8 GEMV microbenchmark at the Llama-3.1-8B decode shapes (GPU), one row: bf16 (cuBLAS), FP8 torch._scaled_mm as
the engine calls it (o / down: bf16 out with the two scales; fused q|k|v and gate|up: fp32 out, unit scales) and
quantlab's one-row FP8 kernel (quantlab.engines.kernels.fp8) over launch configurations, each checked against the
exact arithmetic (float64) before it is timed from CUDA-graph replays over weight copies larger than L2
(bench/decode.py's helpers). First fp8.check at the 8B shapes (bf16 and fp32 out, also against torch._scaled_mm).
Prints the CONFIGS table to commit (the fastest exact configuration per shape where it beats torch._scaled_mm).

    python bench/fp8_kernels.py [--quick] [--budget-s 150] [--out FILE]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as bench  # noqa: E402 - the decode bench's timing helpers

from quantlab.engines.kernels import fp8  # noqa: E402

# (N, K, name, output dtype of the engine's call)
SHAPES = ((4096, 4096, "o", torch.bfloat16), (4096, 14336, "down", torch.bfloat16),
          (6144, 4096, "qkv", torch.float32), (28672, 4096, "gate|up", torch.float32))
TILES = ((16, 512, 4), (16, 256, 2), (32, 256, 4), (8, 512, 2), (8, 1024, 4), (16, 1024, 8), (64, 128, 4))


def candidates(n: int, k: int, quick: bool) -> list[dict]:
    """Tile shapes, each at its default split and the two next to it."""
    out = []
    for block_n, block_k, warps in TILES[:2] if quick else TILES:
        base = fp8.default_config(n, k, block_n=block_n, block_k=block_k, num_warps=warps)
        if base is None:
            continue
        splits = fp8.valid_splits(k, base["block_k"])
        i = splits.index(base["split_k"])
        for s in sorted({splits[0], splits[min(1, len(splits) - 1)], splits[max(0, i - 1)], base["split_k"]}):
            out.append({**base, "split_k": s})
            if k // base["block_k"] // s <= 16:  # few steps: also unrolled
                out.append({**base, "split_k": s, "unroll": True})
    return out


def name(cfg: dict) -> str:
    return (f"n{cfg['block_n']}_k{cfg['block_k']}_w{cfg['num_warps']}_s{cfg['split_k']}"
            + (f"_st{cfg['num_stages']}" if cfg.get("num_stages", 1) > 1 else "") + ("_u" if cfg.get("unroll") else ""))


def shape_tensors(n: int, k: int, g: torch.Generator) -> dict:
    copies = max(1, math.ceil(bench.L2_BYTES / (n * k)))
    ws = [fp8.codes((n, k), g, 0.25) for _ in range(copies)]
    xq = fp8.codes((1, k), g)
    sa, sb = torch.tensor(0.013, device="cuda"), torch.tensor(0.0021, device="cuda")
    return {"ws": ws, "xq": xq, "sa": sa, "sb": sb, "one": torch.ones((), device="cuda"), "copies": copies}


def run_config(t: dict, cfg: dict, dtype: torch.dtype) -> dict:
    """One configuration: its output checked against the exact arithmetic, then timed (inf with the reason when it
    fails or is inexact)."""
    ws, xq, sa, sb = t["ws"], t["xq"], t["sa"], t["sb"]
    try:
        y = fp8.launch(xq, ws[0], sa, sb, dtype, cfg=cfg)
        worst = float(((y.cpu().double() - t["exact"]).abs() / t["bound"]).max())
        if not worst <= 1.0:
            return {"name": name(cfg), "us": float("inf"), "config": cfg, "error": f"inexact {worst:.2f}"}
        us = bench.graph_us(lambda: [fp8.launch(xq, w, sa, sb, dtype, cfg=cfg) for w in ws]) / len(ws)
        return {"name": name(cfg), "us": us, "worst": worst, "config": cfg}
    except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or run is skipped
        fp8.reset_counters()
        return {"name": name(cfg), "us": float("inf"), "config": cfg,
                "error": f"{type(exc).__name__}: {str(exc)[:160]}"}


def time_shape(n: int, k: int, label: str, dtype: torch.dtype, g: torch.Generator, args, t0: float) -> dict:
    """bf16, torch._scaled_mm as the engine calls it, and the kernel's configurations at one shape (M = 1)."""
    t = shape_tensors(n, k, g)
    if dtype == torch.float32:  # the fused paths: fp32 accumulators, unit scales
        t["sa"] = t["sb"] = t["one"]
    ws, sa, sb = t["ws"], t["sa"], t["sb"]
    t["exact"], t["bound"] = fp8.bound(t["xq"].cpu(), ws[0].cpu(), float(sa * sb), dtype)
    bf16_us = bench._dense_us(torch.randn(1, k, device="cuda", generator=g).bfloat16(), n, k, g, False)
    x16 = torch.nn.functional.pad(t["xq"], (0, 0, 0, 15))
    ref = torch._scaled_mm(x16, ws[0].t(), scale_a=sa, scale_b=sb, out_dtype=dtype)[:1].cpu()
    cublas_worst = float(((ref.double() - t["exact"]).abs() / t["bound"]).max())
    cublas_us = bench.graph_us(lambda: [torch._scaled_mm(x16, w.t(), scale_a=sa, scale_b=sb, out_dtype=dtype)
                                        for w in ws]) / len(ws)
    timings = []
    for cfg in candidates(n, k, args.quick):
        if time.time() - t0 > args.budget_s:
            timings.append({"name": name(cfg), "us": float("inf"), "config": cfg, "error": "budget spent"})
            continue
        timings.append(run_config(t, cfg, dtype))
    timings.sort(key=lambda r: r["us"])
    if math.isfinite(timings[0]["us"]) and time.time() - t0 < args.budget_s:  # the best tile, pipelined
        for stages in (2, 3):
            timings.append(run_config(t, {**timings[0]["config"], "num_stages": stages}, dtype))
        timings.sort(key=lambda r: r["us"])
    best = timings[0]
    nbytes = n * k
    print(f"{label} {n}x{k} (out {str(dtype).removeprefix('torch.')}): bf16 {bf16_us:.2f}us | torch._scaled_mm "
          f"{cublas_us:.2f}us ({nbytes / cublas_us / 1e6:.2f} TB/s, worst/bound {cublas_worst:.3f}) | kernel best "
          f"{best['us']:.2f}us ({nbytes / best['us'] / 1e6:.2f} TB/s) {best['name']}: x scaled_mm "
          f"{cublas_us / best['us']:.3f}", flush=True)
    for r in timings[:6]:
        print(f"    {r['name']:24s} {r['us']:7.2f}us {nbytes / r['us'] / 1e6:.2f} TB/s {r.get('error', '')}",
              flush=True)
    bad = [r for r in timings if "error" in r]
    if bad:
        print(f"    {len(bad)} failed or skipped, e.g. {bad[0]['name']}: {bad[0]['error']}", flush=True)
    return {"n": n, "k": k, "out_dtype": str(dtype), "bf16_us": bf16_us, "scaled_mm_us": cublas_us,
            "scaled_mm_worst": cublas_worst, "copies": t["copies"], "timings": timings}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop timing configurations after this")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "shapes": {}}
    cases = ((1, 4096, 4096), (1, 4096, 14336), (1, 6144, 4096), (3, 1024, 4096), (1, 100, 4096))
    rows = fp8.check("cuda", dtypes=(torch.bfloat16, torch.float32), cases=cases)
    for r in rows:
        print(f"check {r['kernel']:18s} M={r['rows']} N={r['n']:5d} K={r['k']:5d} {r['dtype']:8s} "
              f"worst/bound={r['worst']:.3f} (torch._scaled_mm {r.get('scaled_mm_worst', float('nan')):.3f}, "
              f"kernel vs it {r.get('vs_scaled_mm', float('nan')):.3f}) {'ok' if r['ok'] else 'BAD'} "
              f"{r.get('error', '')}", flush=True)
    res["check"] = rows
    res["usable"] = fp8.usable("cuda")
    print(f"usable (startup check): {res['usable']}; check {time.time() - t0:.0f}s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    table = {}
    for n, k, label, dtype in SHAPES:
        r = res["shapes"][f"{label} {n}x{k}"] = time_shape(n, k, label, dtype, g, args, t0)
        if r["timings"][0]["us"] < r["scaled_mm_us"]:
            table[(n, k)] = r["timings"][0]["config"]
        torch.cuda.empty_cache()
    print("CONFIGS = {\n" + "".join(f"    {key}: {cfg},\n" for key, cfg in table.items()) + "}", flush=True)
    res["configs"] = {str(key): cfg for key, cfg in table.items()}
    return bench.finish(res, t0, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
