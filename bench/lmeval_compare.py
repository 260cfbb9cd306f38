"""Perplexity throughput and token-level NLL: quantlab vs lm-evaluation-harness, same model, text and batch.

Both score the same token windows with the same weights and batch size (models loaded outside both timings; lm-eval
wraps one model object, quantlab's reference engine a copy loaded the same way for each of its runs, since the engine
swaps the model's output head for a hidden-state capture):
- quantlab: the data stage (quantlab.stages.data.run with the EVAL role: tokenize, cut windows of eval.prefix_token +
  seq_len - 1 text tokens) and the reference stage (quantlab.stages.evaluate.ReferenceOutputs, block by block:
  forward, per-token NLL and argmax, and the final hidden states it stores so that every candidate's exact KL can
  recompute the reference's logits), cold cache.
- lm-eval: `simple_evaluate` of a local task definition (output_type loglikelihood_rolling over a JSON file
  with one document per window, the decoded text of that window), `hf` model wrapping the same object.
lm-eval scores a document as prefix token + its tokens in one window when it fits max_length, which is the
window quantlab builds with eval.prefix_token set to the same token (lm-eval: BOS if the tokenizer has one,
else EOS). Documents whose decoded text does not re-encode to the same tokens are left out of both sides.

Wall and CPU seconds (all threads of the process) are printed; the wall ratio is the figure on an idle machine, the
CPU ratio the comparable one where other jobs share the cores.

    python bench/lmeval_compare.py [--text ../shared/data/wikitext-2-raw/wiki.valid.raw] [--windows 32] [--seq 512]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

TASK_YAML = """task: quantlab_windows
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text",
                    default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.valid.raw"))
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    return ap.parse_args()


def _formula_errors(model, first):
    """Where a difference comes from: quantlab's NLL formula and log_softmax's on the same fp32 logits, each
    against float64 (per token)."""
    import torch

    from quantlab.gate import metrics

    with torch.no_grad():
        logits = model(first, use_cache=False).logits.float()
    target = first[:, 1:]
    x = logits[:, :-1]
    exact = torch.logsumexp(x.double(), -1) - x.double().gather(-1, target[..., None])[..., 0]
    log_softmax_err = (-torch.log_softmax(x, -1).gather(-1, target[..., None])[..., 0]).double() - exact
    ours_err = metrics.nll_and_argmax(x, target)[0].double() - exact
    return ours_err, log_softmax_err


def main() -> None:
    import torch
    from _converted import seed_converted_model

    from quantlab import api
    from quantlab.artifacts import ArtifactStore
    from quantlab.engines.hf import HFModelEngine
    from quantlab.graph import Executor, steps_for
    from quantlab.models import load_model, load_tokenizer
    from quantlab.pipeline import context
    from quantlab.stages import build, data, evaluate

    args = _parse_args()
    torch.manual_seed(0)

    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def config(cache: Path, prefix: str = "bos"):
            return api.config(["+precision=fp8", "engine=reference", f"cache_dir={cache}", f"eval.path={args.text}",
                               f"eval.max_windows={args.windows}", f"eval.seq_len={args.seq}",
                               f"eval.batch_size={args.batch}", "eval.gen_prompts=0", f"eval.prefix_token={prefix}",
                               f"gate.statistical.look_windows={min(8, args.windows)}"])

        # the converted model, kept out of both timings
        seed_converted_model(tmp / "model_cache")
        ctx = context(config(tmp / "model_cache"))
        ref = Executor(ctx, steps_for(ctx)).value("prepare")
        tok = load_tokenizer(ref)
        device, dtype = ctx.device, ctx.dtype
        model = load_model(ref, device, dtype)
        prefix = "bos" if tok.bos_token_id is not None else "eos"
        cfg = config(tmp / "model_cache", prefix)
        limits = build.limits_for(cfg, ref.max_positions)
        lm = HFLM(pretrained=model, tokenizer=tok, batch_size=args.batch, max_length=args.seq)
        assert lm.prefix_token_id == getattr(tok, f"{prefix}_token_id")

        # the documents lm-eval scores: each window's text, kept when it re-encodes to the same tokens
        probe = data.run(cfg.eval, data.EVAL, ref.fingerprint, tok, ArtifactStore(tmp / "probe"))
        docs, keep = [], []
        for i, window in enumerate(probe.tokens):
            text = tok.decode(window[1:].tolist())
            if lm.tok_encode(text) == window[1:].tolist():
                docs.append({"text": text})
                keep.append(i)
        (tmp / "docs.json").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
        (tmp / "tasks").mkdir()
        (tmp / "tasks" / "quantlab_windows.yaml").write_text(TASK_YAML.format(data=tmp / "docs.json"))

        def run_quantlab(i: int):  # tokenize + windows + reference pass, cold cache
            cold = context(config(tmp / f"cold{i}", prefix))  # the run's context on an empty store (not timed)
            own = load_model(ref, device, dtype)  # the engine takes the model's head: a copy (not timed)
            start, cpu = time.time(), time.process_time()
            evalset = data.run(cfg.eval, data.EVAL, ref.fingerprint, tok, cold.store)
            data_s = time.time() - start
            base = evaluate.reference_key(cold.store, ref.fingerprint, evalset.fingerprint, cfg.eval, device, dtype,
                                          cfg.gate.statistical.look_windows)
            outputs = evaluate.ReferenceOutputs(cold, base, evalset, lambda: HFModelEngine(own, limits, "reference"))
            blocks = math.ceil(evalset.num_windows / outputs.block_windows)
            nll = torch.cat([outputs.block(b)["nll"] for b in range(blocks)])
            return time.time() - start, time.process_time() - cpu, data_s, evalset, nll

        def run_lmeval():  # local task, same weights and batch size
            start, cpu = time.time(), time.process_time()
            out = simple_evaluate(model=lm, tasks=["quantlab_windows"], log_samples=True, batch_size=args.batch,
                                  task_manager=TaskManager(include_path=str(tmp / "tasks")))
            return time.time() - start, time.process_time() - cpu, out

        ours_all, theirs_all, ours_cpu, theirs_cpu = [], [], [], []
        for i in range(args.repeat):  # alternating, so drift of the machine hits both
            ours, cpu, data_s, evalset, nll = run_quantlab(i)
            ours_all.append(ours)
            ours_cpu.append(cpu)
            theirs, cpu, out = run_lmeval()
            theirs_all.append(theirs)
            theirs_cpu.append(cpu)
        ours, theirs = min(ours_all), min(theirs_all)
        nll = nll.double()

        ours_err, log_softmax_err = _formula_errors(model, probe.tokens[: args.batch])

    samples = sorted(out["samples"]["quantlab_windows"], key=lambda s: s["doc_id"])
    lm_ll = [float(s["resps"][0][0]) if isinstance(s["resps"][0], (list, tuple)) else float(s["resps"][0])
             for s in samples]
    ql_nll = [float(nll[i].sum()) for i in keep]
    diffs = [abs(-a - b) for a, b in zip(lm_ll, ql_nll, strict=False)]
    rel = [d / b for d, b in zip(diffs, ql_nll, strict=False)]
    total_lm, total_ql = -sum(lm_ll), sum(ql_nll)
    n_tok = len(keep) * (args.seq - 1)
    scored = evalset.num_windows * (args.seq - 1)
    print(f"text {args.text}: {evalset.num_windows} windows x ({prefix} + {args.seq - 1} tokens), batch {args.batch}, "
          f"{device.name} {str(dtype).removeprefix('torch.')}, SmolLM2-135M; {len(keep)}/{probe.num_windows} windows "
          f"re-encode exactly and are compared")
    print(f"NLL sum over the compared windows: quantlab {total_ql:.6f}, lm-eval {total_lm:.6f}, relative difference "
          f"{abs(total_lm - total_ql) / total_ql:.2e}; per window: max |diff| {max(diffs):.2e} nats, "
          f"max relative {max(rel):.2e}")
    print(f"error per token vs float64 on the same fp32 logits ({args.batch} windows): quantlab (logits - logsumexp) "
          f"mean {ours_err.mean():+.2e} nats, max |.| {ours_err.abs().max():.2e}; log_softmax (lm-eval) mean "
          f"{log_softmax_err.mean():+.2e}, max |.| {log_softmax_err.abs().max():.2e}")
    print(f"token perplexity over them: quantlab {math.exp(total_ql / n_tok):.4f}, "
          f"lm-eval {math.exp(total_lm / n_tok):.4f}")
    print(f"wall: quantlab {ours:.1f} s ({scored / ours:.0f} tok/s; data stage {data_s:.1f} s, reference stage "
          f"{ours - data_s:.1f} s incl. storing the hidden states for KL), "
          f"lm-eval {theirs:.1f} s ({n_tok / theirs:.0f} tok/s, simple_evaluate); "
          f"best of {args.repeat} alternating runs "
          f"(quantlab {', '.join(f'{t:.1f}' for t in ours_all)}; lm-eval {', '.join(f'{t:.1f}' for t in theirs_all)}); "
          f"ratio lm-eval / quantlab {theirs / ours:.2f} (target > 1: quantlab faster)")
    print(f"CPU (all threads, {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}): quantlab "
          f"{', '.join(f'{t:.1f}' for t in ours_cpu)} s, lm-eval {', '.join(f'{t:.1f}' for t in theirs_cpu)} s; "
          f"ratio of the best lm-eval / quantlab {min(theirs_cpu) / min(ours_cpu):.2f} (the comparable figure where "
          f"other jobs share the cores)")


if __name__ == "__main__":
    main()
