"""Calibration overhead: quantlab's quantize stage vs a bare mtq.quantize, same model, windows and config.

Both on the default model with the calibration windows the run's data step made (calib.num_samples x calib.seq_len,
batches of 4), in one process, a fresh artifact cache (seeded with the converted model when the user's cache has it:
bench/_converted.py; the conversion and the tokenizing are done before either timing):
- bare: load the model (quantlab.models.load_model), mtq.quantize(model, cfg, forward_loop) with a plain forward loop;
- quantlab: the run graph's quantize step (quantlab.graph.Executor on quantlab.graph.steps_for), as a run builds it:
  the block size resolved on the model, the same load and calibration, the pickle-free state saved, the artifact
  manifest and its fingerprint written.
Prints wall and CPU seconds (all threads of the process) of both and their ratios; the wall ratio is the figure on
an idle machine, the CPU ratio the comparable one where other jobs share the cores. Target: <= 1.1x.

    python bench/calib_overhead.py [--precision int8_sq] [--samples 16] [--seq 512]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from _converted import seed_converted_model

    from quantlab import api
    from quantlab.graph import Executor, steps_for
    from quantlab.models import load_model
    from quantlab.pipeline import context
    from quantlab.precisions import modelopt_config
    from quantlab.stages import quantize

    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="int8_sq")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as cache:
        seed_converted_model(cache)
        cfg = api.config([f"+precision={args.precision}", f"cache_dir={cache}", f"calib.num_samples={args.samples}",
                          f"calib.seq_len={args.seq}", f"calib.batch_size={args.batch}"])
        ctx = context(cfg)
        run = Executor(ctx, steps_for(ctx))
        ref, calib = run.value("prepare"), run.value("data:calib")  # conversion and tokenizing: not timed
        req = quantize.request(run)  # the recipe, its block size resolved on the model, as the step keys it
        mo_cfg = modelopt_config(cfg.precision, cfg.kv_cache, req.recipe["block_size"])

        start, cpu = time.time(), time.process_time()
        model = load_model(ref, ctx.device, ctx.dtype)

        def loop(m):
            with torch.no_grad():
                for batch in torch.split(calib.tokens, args.batch):
                    m(batch)

        mtq.quantize(model, mo_cfg, loop)
        bare, bare_cpu = time.time() - start, time.process_time() - cpu
        del model

        start, cpu = time.time(), time.process_time()
        run.value("quantize")
        ours, ours_cpu = time.time() - start, time.process_time() - cpu
        events = [a for s, _, a in ctx.store.events if s == "quantize"]
        assert events == ["built"], f"the quantize step was not built in this run: {events}"
    print(f"{args.precision} (block size {req.recipe['block_size']}), {args.samples} x {args.seq} tokens, batches of "
          f"{args.batch}, {ctx.device.name} {str(ctx.dtype).removeprefix('torch.')}, {torch.get_num_threads()} "
          f"thread(s), load average {os.getloadavg()[0]:.1f}")
    print(f"bare mtq.quantize {bare:.1f} s, quantlab quantize step {ours:.1f} s: wall ratio {ours / bare:.3f}; CPU "
          f"{bare_cpu:.1f} s vs {ours_cpu:.1f} s: CPU ratio {ours_cpu / bare_cpu:.3f} (target <= 1.1)")


if __name__ == "__main__":
    main()
