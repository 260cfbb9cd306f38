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
Target: <= 1.15x.

    python bench/eval_overhead.py [--windows 16] [--seq 512]
"""
from __future__ import annotations

import argparse
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
    tokens = evalset.num_windows * evalset.seq_len
    m = result.metrics
    print(f"{evalset.num_windows} windows x {evalset.seq_len} tokens, batch {args.batch}, {ctx.device.name} "
          f"{str(ctx.dtype).removeprefix('torch.')}, {torch.get_num_threads()} thread(s), load average "
          f"{os.getloadavg()[0]:.1f}; quantlab: {reference.forward_batches} reference + "
          f"{result.forward_batches} candidate forward batches, ppl {m['ppl_reference']['value']:.4f}, top-1 "
          f"{m['top1_agreement']['value']}, {len(result.checks)} gate checks")
    print(f"bare forwards: {bare:.1f} s ({2 * tokens / bare:.0f} tok/s); quantlab evaluation: {ours:.1f} s; "
          f"wall ratio {ours / bare:.3f}; CPU {bare_cpu:.1f} s vs {ours_cpu:.1f} s: CPU ratio "
          f"{ours_cpu / bare_cpu:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
