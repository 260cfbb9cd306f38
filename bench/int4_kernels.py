"""W4A16 kernel microbenchmark at the Llama-3.1-8B decode shapes (GPU): bf16 (cuBLAS), FP8 (torch._scaled_mm) and
the k8 kernels' configurations per shape and row count, each checked against the exact arithmetic (float64) and
timed from CUDA-graph replays over weight copies larger than L2 (bench/decode.py's sweep helpers). Also runs
int4.check at the model's shapes in bf16 and fp16. For iterating on the kernels; bench/decode.py --check is the
end-to-end measurement.

    python bench/int4_kernels.py [--rows 1,16] [--quick] [--out FILE]
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

from quantlab.engines.kernels import int4  # noqa: E402


def candidates(m: int, n: int, k: int, quick: bool) -> list[dict]:
    """The k8 configurations timed for M rows: the defaults, the one-row kernel over tile shapes (one row), and the
    tensor-core sweep's candidates."""
    out = [{"name": "dot_default", **int4.k8_dot_config(m, n, k)}]
    if m <= int4.MMA_ROWS and torch.cuda.is_available() and int4.mma_on("cuda", torch.bfloat16):
        out += [{"name": f"mma_w{w}_u{u}_t{r}", **int4.mma_config(k, w, u, r)} for w, u, r in int4.MMA_SHAPES
                if n % (16 * r) == 0]
    if m == 1:
        shapes = [(64, 2, 4), (128, 1, 4), (64, 1, 4), (128, 2, 4), (256, 1, 4), (64, 1, 2), (32, 2, 2)]
        if quick:
            shapes = shapes[:2]
        for block_n, bpi, warps in shapes:
            base = int4.k8_gemv_config(n, k, block_n=block_n, bpi=bpi, num_warps=warps)
            splits = int4.valid_splits(k, base["bpi"])
            i = splits.index(base["split_k"])
            for s in sorted({splits[max(0, i - 1)], base["split_k"], splits[min(len(splits) - 1, i + 1)]}):
                out.append({"name": f"gemv_n{block_n}_b{base['bpi']}_w{warps}_s{s}", **base, "split_k": s})
    if not quick and m != 1:
        out += [{"name": "sweep", **c} for c in int4.sweep_candidates(m, n, k)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "shapes": {}}
    cases = ((1, 4096, 4096, 128, True), (1, 28672, 4096, 128, False), (1, 4096, 14336, 128, True),
             (1, 6144, 4096, 64, True), (1, 1024, 4096, 32, False), (16, 6144, 4096, 128, True))
    rows = int4.check("cuda", dtypes=(torch.bfloat16, torch.float16), cases=cases, layouts=("k8", "mma"))
    for r in rows:
        print(f"check {r['kernel']:14s} M={r['rows']:3d} N={r['n']:5d} K={r['k']:5d} g={r['group']:3d} "
              f"{r['dtype']:8s} worst/bound={r['worst']:.3f} {'ok' if r['ok'] else 'BAD'} {r.get('error', '')}",
              flush=True)
    res["check"] = rows
    g = torch.Generator(device="cuda").manual_seed(0)
    for m in (int(v) for v in args.rows.split(",")):
        for n, k in bench.SWEEP_SHAPES:
            t = bench._sweep_tensors(m, n, k, g)
            ref = {"bf16_us": bench._dense_us(t["x"], n, k, g, False), "fp8_us": bench._dense_us(t["x"], n, k, g, True)}
            nbytes = n * k / 2 + n * k / bench.GROUP * 2
            timings = []
            for cfg in candidates(m, n, k, args.quick or m != 1):
                c = {key: v for key, v in cfg.items() if key != "name"}
                us, why = bench._sweep_config(t, c)
                timings.append({"name": cfg["name"], "us": us, "TBps": nbytes / us / 1e6 if math.isfinite(us) else 0,
                                "config": c, **({"error": why} if why else {})})
            timings.sort(key=lambda r: r["us"])
            key = f"M{m}_N{n}_K{k}"
            res["shapes"][key] = {**ref, "int4_bytes": nbytes, "timings": timings}
            print(f"{key}: bf16 {ref['bf16_us']:.1f}us ({n * k * 2 / ref['bf16_us'] / 1e6:.2f} TB/s) "
                  f"fp8 {ref['fp8_us']:.1f}us ({n * k / ref['fp8_us'] / 1e6:.2f} TB/s)", flush=True)
            for r in timings[:8] + [r for r in timings[8:] if r["name"] == "dot_default"]:
                ratio = ref["bf16_us"] / r["us"]
                print(f"    {r['name']:26s} {r['us']:7.2f}us {r['TBps']:.2f} TB/s  x bf16 {ratio:.2f}"
                      f"  {r.get('error', '')}", flush=True)
            bad = [r for r in timings if "error" in r]
            if bad:
                print(f"    {len(bad)} failed, e.g. {bad[0]['name']}: {bad[0]['error']}", flush=True)
            del t
            torch.cuda.empty_cache()
    return bench.finish(res, t0, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
