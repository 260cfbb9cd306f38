"""Evaluation overhead: quantlab's evaluation vs the bare forward passes it needs, same model, tokens and batch.

bare: reference forward over every batch + candidate forward over every batch, logits discarded.
quantlab: what a run's evaluation does, through quantlab.stages.evaluate in a fresh artifact cache: the reference's
blocks (ReferenceOutputs: final hidden states, per-token NLL and argmax, stored), then the candidate's blocks
(CandidateBlocks: the reference's logits recomputed from its stored hidden states by its head, compared with the
candidate's: NLLs, exact full-vocabulary KL, delta-p, agreement; stored), then the gate's checks and intervals on
every window (run_sequential with a fixed n: the metrics, CIs and checks of metrics.json).
Both use the same in-memory model objects (the candidate is the unquantized model, as engine=reference runs it), so
only the metric and caching work differs. Prints wall and CPU seconds (all threads of the process) and their ratios;
the wall ratio is the figure on an idle machine, the CPU ratio the comparable one where other jobs share the cores.
Target: <= 1.15x. With --profile the quantlab side runs under cProfile with a CPU-time clock and the CPU seconds of
its parts are printed (model forwards, output-head logits, the comparison of full-vocabulary distributions, storing
and hashing artifacts, the gate's statistics); profiling slows Python-level work a little, so the ratio of such a run
is not the figure.

    python bench/eval_overhead.py [--windows 16] [--seq 512] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import tempfile
import time


def main() -> None:
    import torch
    from _converted import seed_converted_model

    from quantlab import api
    from quantlab.engines.hf import HFModelEngine
    from quantlab.engines.registry import ENGINES
    from quantlab.gate import checks as gate_checks
    from quantlab.graph import Executor, steps_for
    from quantlab.models import load_model, load_tokenizer
    from quantlab.pipeline import context
    from quantlab.stages import build, evaluate

    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="CPU seconds of the parts of quantlab's evaluation")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as cache:
        seed_converted_model(cache)  # the converted model, if the user's cache has it (not timed either way)
        cfg = api.config(["+precision=fp8", "engine=reference", f"cache_dir={cache}",
                          f"eval.max_windows={args.windows}", f"eval.seq_len={args.seq}",
                          f"eval.batch_size={args.batch}", "eval.gen_prompts=0",
                          f"gate.statistical.look_windows={min(8, args.windows)}"])
        ctx = context(cfg)
        run = Executor(ctx, steps_for(ctx))
        ref, evalset = run.value("prepare"), run.value("data:eval")
        tok = load_tokenizer(ref)
        model_r = load_model(ref, ctx.device, ctx.dtype)
        model_c = load_model(ref, ctx.device, ctx.dtype)
        limits = build.limits_for(cfg, ref.max_positions)

        start, cpu = time.time(), time.process_time()
        with torch.no_grad():
            for m in (model_r, model_c):
                for batch in torch.split(evalset.tokens, args.batch):
                    m(batch, use_cache=False).logits.float()
        bare, bare_cpu = time.time() - start, time.process_time() - cpu

        prof = cProfile.Profile(time.process_time) if args.profile else None
        if prof:
            prof.enable()
        start, cpu = time.time(), time.process_time()
        base = evaluate.reference_key(ctx.store, ref.fingerprint, evalset.fingerprint, cfg.eval, ctx.device, ctx.dtype,
                                      cfg.gate.statistical.look_windows)
        reference = evaluate.ReferenceOutputs(ctx, base, evalset, lambda: HFModelEngine(model_r, limits, "reference"))
        candidate = evaluate.CandidateBlocks(ENGINES["reference"], ref.fingerprint, reference,
                                             lambda: HFModelEngine(model_c, limits, "candidate"), limits)
        thresholds = gate_checks.thresholds_for(cfg.gate, ctx.precision.name, cfg.eval.seq_len)
        design = gate_checks.design_for(cfg.gate, evalset.num_windows, cfg.eval.max_windows)
        result = evaluate.run_sequential(candidate, thresholds, design, None, tok, fixed_n=evalset.num_windows)
        ours, ours_cpu = time.time() - start, time.process_time() - cpu
        if prof:
            prof.disable()
    tokens = evalset.num_windows * evalset.seq_len
    m = result.metrics
    print(f"{evalset.num_windows} windows x {evalset.seq_len} tokens, batch {args.batch}, {ctx.device.name} "
          f"{str(ctx.dtype).removeprefix('torch.')}, {torch.get_num_threads()} thread(s), load average "
          f"{os.getloadavg()[0]:.1f}; quantlab: {reference.forward_batches} reference + "
          f"{result.forward_batches} candidate forward batches, ppl {m['ppl_reference']['value']:.4f}, top-1 "
          f"{m['top1_agreement']['value']}, {len(result.checks)} gate checks")
    print(f"bare forwards: {bare:.1f} s ({2 * tokens / bare:.0f} tok/s); quantlab evaluation: {ours:.1f} s; "
          f"wall ratio {ours / bare:.3f}; CPU {bare_cpu:.1f} s vs {ours_cpu:.1f} s: CPU ratio "
          f"{ours_cpu / bare_cpu:.3f} (target <= 1.15){' (profiled run)' if prof else ''}")
    if prof:
        print(f"quantlab's evaluation, CPU seconds by part (cumulative, overlapping where nested): {parts(prof)}")


PARTS = {  # label: (file suffix, function) of the entry points whose cumulative CPU time is reported
    "model forwards (hidden states)": ("engines/hf.py", "_forward"),
    "head verification": ("engines/hf.py", "verify_head"),
    "output-head logits (Head.__call__)": ("engines/head.py", "__call__"),
    "reference NLL + argmax": ("gate/metrics.py", "nll_and_argmax"),
    "candidate vs reference per position (full-vocabulary KL etc.)": ("gate/metrics.py", "compare_positions"),
    "hashing artifact files": ("quantlab/artifacts.py", "fingerprint_files"),
    "safetensors save_file": ("safetensors/torch.py", "save_file"),
    "safetensors load_file": ("safetensors/torch.py", "load_file"),
    "metrics and intervals (result_of)": ("stages/evaluate.py", "result_of"),
    "gate checks (evaluate_checks)": ("gate/checks.py", "evaluate_checks"),
}


def parts(prof) -> str:
    import pstats

    stats = pstats.Stats(prof).stats
    out = []
    for label, (suffix, func) in PARTS.items():
        total = sum(v[3] for (file, _, name), v in stats.items() if name == func and file.endswith(suffix))
        out.append(f"{label} {total:.1f}")
    return "; ".join(out)


if __name__ == "__main__":
    main()
