"""Peak RSS of evaluation vs number of windows (1x and 8x), and of calibration vs number of calibration samples
(1x and 8x): both stream batches, so neither should grow with the data.

Each measurement runs in its own process, on the embedded SmolLM2 with the pydoc text, in one artifact cache (the
GGUF conversion warmed first): evaluation = the reference's blocks computed and stored (quantlab.stages.evaluate
ReferenceOutputs), then a candidate (the unquantized model again, as engine=reference runs it) compared on every
window (CandidateBlocks, run_sequential with a fixed n; each block's reference logits recomputed from the stored
hidden states); calibration = the quantize step's calibrate (int8_sq: SmoothQuant statistics, batches of 4).
Target: 8x the data costs < 10% more peak RSS.

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


def child(windows: int, seq: int, cache: str, look: int) -> None:
    """Evaluation: the reference's blocks, then one candidate compared on every window (quantlab.stages.evaluate as a
    run does it; each engine loads its own model, as a run's engines do). The model and windows come from the shared
    cache; the evaluation is computed into a store of this process's own, so every repeat computes it."""
    from quantlab.artifacts import ArtifactStore
    from quantlab.engines.hf import HFModelEngine
    from quantlab.engines.registry import ENGINES
    from quantlab.gate import checks as gate_checks
    from quantlab.graph import Executor, steps_for
    from quantlab.models import load_model, load_tokenizer
    from quantlab.pipeline import context
    from quantlab.stages import build, evaluate
    from quantlab.step import RunContext

    cfg = api_config(["+precision=fp8", "engine=reference", f"cache_dir={cache}", f"eval.max_windows={windows}",
                      f"eval.seq_len={seq}", "eval.batch_size=4", "eval.gen_prompts=0",
                      f"gate.statistical.look_windows={look}"])
    ctx = context(cfg)
    run = Executor(ctx, steps_for(ctx))
    ref, evalset = run.value("prepare"), run.value("data:eval")
    limits = build.limits_for(cfg, ref.max_positions)

    def engine(name: str):
        return lambda: HFModelEngine(load_model(ref, ctx.device, ctx.dtype), limits, name)

    own = tempfile.TemporaryDirectory()
    ectx = RunContext(cfg, ArtifactStore(own.name), ctx.device, ctx.dtype)
    start = time.time()
    base = evaluate.reference_key(ectx.store, ref.fingerprint, evalset.fingerprint, cfg.eval, ctx.device, ctx.dtype,
                                  cfg.gate.statistical.look_windows)
    reference = evaluate.ReferenceOutputs(ectx, base, evalset, engine("reference"))
    candidate = evaluate.CandidateBlocks(ENGINES["reference"], ref.fingerprint, reference, engine("candidate"), limits)
    design = gate_checks.design_for(cfg.gate, evalset.num_windows, cfg.eval.max_windows)
    result = evaluate.run_sequential(candidate, gate_checks.thresholds_for(cfg.gate, "fp8", seq), design, None,
                                     load_tokenizer(ref), fixed_n=evalset.num_windows)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"windows": evalset.num_windows, "tokens": evalset.num_windows * seq, "peak_rss_mib": peak,
                      "seconds": time.time() - start, "ppl": result.metrics["ppl_reference"]["value"]}))
    own.cleanup()


def child_calib(samples: int, seq: int, cache: str, _look: int) -> None:
    """Calibration: the quantize step's calibrate (int8_sq: SmoothQuant statistics, batches of 4), not saved."""
    from quantlab.graph import Executor, steps_for
    from quantlab.pipeline import context
    from quantlab.precisions import modelopt_config
    from quantlab.stages import quantize

    cfg = api_config(["+precision=int8_sq", f"cache_dir={cache}", f"calib.num_samples={samples}",
                      f"calib.seq_len={seq}", "calib.batch_size=4"])
    ctx = context(cfg)
    run = Executor(ctx, steps_for(ctx))
    ref, calib = run.value("prepare"), run.value("data:calib")
    req = quantize.request(run)
    req.modelopt_cfg = modelopt_config(cfg.precision, cfg.kv_cache, req.recipe["block_size"])
    start = time.time()
    quantize.calibrate(ref, calib, req, ctx.device, ctx.dtype)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"windows": calib.num_windows, "tokens": calib.num_windows * seq, "peak_rss_mib": peak,
                      "seconds": time.time() - start}))


def api_config(overrides: list[str]):
    from quantlab import api

    return api.config(overrides)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--child", type=int)
    ap.add_argument("--cache")
    ap.add_argument("--what", choices=("eval", "calib"), default="eval")
    ap.add_argument("--repeat", type=int, default=3, help="processes per size; the median peak RSS is compared")
    ap.add_argument("--look", type=int, help="windows per evaluation block (default: min(8, --windows), the same for "
                                             "both sizes, so the larger evaluates more blocks of the same size)")
    args = ap.parse_args()
    if args.child:
        (child if args.what == "eval" else child_calib)(args.child, args.seq, args.cache, args.look)
        return
    look = args.look or min(8, args.windows)
    with tempfile.TemporaryDirectory() as cache:
        from _converted import seed_converted_model

        seed_converted_model(cache)  # the converted model, if the user's cache has it
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        # warm the conversion so both measurements see the same cache state (2: a paired interval needs 2 windows)
        subprocess.run([sys.executable, __file__, "--child", "2", "--seq", str(args.seq), "--cache", cache,
                        "--what", args.what, "--look", "2"], env=env, check=True, capture_output=True)
        rows = []
        for n in (args.windows, 8 * args.windows):
            runs = []
            for _ in range(args.repeat):  # peak RSS of one process varies by several % with allocator luck
                out = subprocess.run([sys.executable, __file__, "--child", str(n), "--seq", str(args.seq), "--cache",
                                      cache, "--what", args.what, "--look", str(look)], env=env, check=True,
                                     capture_output=True, text=True)
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
