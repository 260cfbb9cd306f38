"""Sweep cost: quantlab vs a naive per-precision pipeline, same model / data / settings, in one run.

naive, per precision: load the model, mtq.quantize with the same calibration windows, then evaluate reference
and candidate with plain transformers forwards on the same windows, NLL from log_softmax in float64 (exact up to
the logits; fp32 log_softmax would itself be off by ~8e-6 nats per token, more than the 1e-6 this checks).
quantlab: `python -m quantlab -m +precision=...` with engine=fakequant (the same candidate), cold cache.
Prints wall and CPU seconds (all threads; quantlab's process measured as a child), forward-pass counts, the ratios
(target <= 0.6; the wall ratio is the figure on an idle machine, the CPU ratio the comparable one where other jobs
share the cores) and the metric differences.

    python bench/sweep_cost.py [--windows 8] [--calib 8] [--precisions fp8,int8_sq,int4_awq]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def naive(precisions, windows: int, calib: int, seq: int, cache: Path) -> tuple:
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM

    from quantlab import api
    from quantlab.config import KvCacheConfig
    from quantlab.graph import Executor, steps_for
    from quantlab.models import quantized_in_dims
    from quantlab.pipeline import context
    from quantlab.precisions import PRECISION_SCHEMAS, modelopt_config, resolve_block_size

    # only to find the converted checkpoint and the same token windows quantlab's sweep used (its artifacts)
    cfg = api.config(["+precision=fp8", f"cache_dir={cache}", *settings(windows, calib, seq)])
    ctx = context(cfg)
    run = Executor(ctx, steps_for(ctx))
    ref = run.value("prepare")
    cal, ev = run.value("data:calib").tokens, run.value("data:eval").tokens
    assert {a for s, _, a in ctx.store.events} == {"reused"}, "the naive pipeline must read quantlab's windows"
    dims = quantized_in_dims(ref)
    forwards, out = 0, {}
    start, cpu = time.time(), time.process_time()
    for name in precisions:
        prec = PRECISION_SCHEMAS[name]()
        block, _ = resolve_block_size(prec, dims)  # int4_awq: 64 on this model, as quantlab's block_size=auto
        model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32).eval()
        reference = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32).eval()

        def loop(m):
            nonlocal forwards
            with torch.no_grad():
                for b in torch.split(cal, 4):
                    m(b)
                    forwards += 1

        mtq.quantize(model, modelopt_config(prec, KvCacheConfig(), block), loop)
        nll_r = nll_c = agree = 0.0
        with torch.no_grad():
            for b in torch.split(ev, 4):
                lr, lc = reference(b).logits, model(b).logits
                forwards += 2
                tgt = b[:, 1:]
                for logits, acc in ((lr, "r"), (lc, "c")):
                    lp = torch.log_softmax(logits[:, :-1].double(), -1)  # float64: the exact reference
                    s = -lp.gather(-1, tgt.unsqueeze(-1)).sum().item()
                    nll_r, nll_c = (nll_r + s, nll_c) if acc == "r" else (nll_r, nll_c + s)
                agree += (lr[:, :-1].argmax(-1) == lc[:, :-1].argmax(-1)).sum().item()
        n = ev.shape[0] * (ev.shape[1] - 1)
        out[name] = {"ppl_reference": math.exp(nll_r / n), "ppl_candidate": math.exp(nll_c / n),
                     "top1_agreement": agree / n}
    return time.time() - start, time.process_time() - cpu, out, forwards


def settings(windows: int, calib: int, seq: int) -> list[str]:
    """The overrides both pipelines share (every window evaluated: one look, a fixed-n design)."""
    return [f"eval.max_windows={windows}", f"calib.num_samples={calib}", f"calib.seq_len={seq}", f"eval.seq_len={seq}",
            "eval.gen_prompts=0", "eval.batch_size=4", "calib.batch_size=4", "gate.statistical.sequential=false"]


def quantlab(precisions, windows: int, calib: int, seq: int, cache: Path, workdir: Path) -> tuple:
    args = [sys.executable, "-m", "quantlab", "-m", f"+precision={','.join(precisions)}", "engine=fakequant",
            *settings(windows, calib, seq)]
    env = {**os.environ, "QUANTLAB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    start, before = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(args, cwd=workdir, env=env, check=False, capture_output=True, text=True)
    wall, after = time.time() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if proc.returncode not in (0, 1):  # 1: a gate failed, which is a result here
        raise SystemExit(f"quantlab exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    out, forwards = {}, 0
    for run in sorted((workdir / "outputs").glob("sweep_*/*/metrics.json")):
        doc = json.loads(run.read_text())
        rec = json.loads((run.parent / "run.json").read_text())
        m = doc["metrics"]
        out[doc["run"]["precision"]] = {k: m[k]["value"] for k in ("ppl_reference", "ppl_candidate", "top1_agreement")}
        forwards += doc["run"]["reference_forward_batches"] + doc["run"]["candidate_forward_batches"]
        forwards += rec.get("artifacts", {}).get("quantize", {}).get("calib_forward_batches", 0)
        print(f"quantlab {doc['run']['precision']}: stage seconds {rec['stage_seconds']}")
    return wall, cpu, out, forwards


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--calib", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--precisions", default="fp8,int8_sq,int4_awq")
    args = ap.parse_args()
    precisions = args.precisions.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        # The one-time GGUF conversion is shared setup, not part of either pipeline's cost: copied from the user's
        # cache when it is there, else done here (the prepare step, in this process).
        from _converted import seed_converted_model

        from quantlab import api
        from quantlab.graph import Executor, steps_for
        from quantlab.pipeline import context

        seed_converted_model(cache)
        ctx = context(api.config(["+precision=fp8", f"cache_dir={cache}"]))
        Executor(ctx, steps_for(ctx)).value("prepare")
        t_q, c_q, m_q, f_q = quantlab(precisions, args.windows, args.calib, args.seq, cache, tmp)
        t_n, c_n, m_n, f_n = naive(precisions, args.windows, args.calib, args.seq, tmp / "cache")
    worst = max(abs(m_q[p][k] - m_n[p][k]) / abs(m_n[p][k]) for p in precisions for k in m_n[p])
    print(json.dumps({"quantlab": m_q, "naive": m_n}, indent=1))
    print(f"wall: quantlab {t_q:.1f} s, naive {t_n:.1f} s, ratio {t_q / t_n:.2f}; CPU (all threads): quantlab "
          f"{c_q:.1f} s, naive {c_n:.1f} s, ratio {c_q / c_n:.2f} (target <= 0.6; load average "
          f"{os.getloadavg()[0]:.1f})")
    print(f"forward batches: quantlab {f_q}, naive {f_n}; largest relative metric difference {worst:.2e} (target 1e-6)")


if __name__ == "__main__":
    main()
