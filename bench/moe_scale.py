"""A Mixture-of-Experts model at real per-layer size through the whole pipeline (issue "the models people ship").

A random-weight Qwen3-MoE with the per-layer shape of Qwen3-30B-A3B (hidden 2048, 32 query / 4 KV heads of 128,
128 experts of intermediate 768, top-8 routing) and --layers layers (2: ~1.2 B parameters, almost all in experts),
the tests' small pydoc tokenizer, saved by transformers in bf16 safetensors. Then the real CLI sweeps the
precisions on it in subprocesses (calibration of every expert, export, audit, torch engine on the export, gate) and
the bench records per precision: exit code, wall time per stage, export size, the experts calibration reached and
the fewest tokens any expert got, router top-k agreement. Random weights: the quality numbers mean nothing; wall
time, memory and coverage do.

    HF_HUB_OFFLINE=1 python bench/moe_scale.py --out /tmp/moe [--layers 2] [--precisions fp8,int4_awq,nvfp4]
        [--hidden 2048 --heads 32 --head-dim 128 --experts 128 --intermediate 768 --topk 8]  (smaller: a CPU smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def build(out: Path, args) -> dict:
    import torch
    import transformers as tf
    from _builders import train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    cfg = tf.Qwen3MoeConfig(vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.heads, num_key_value_heads=4, head_dim=args.head_dim,
                            intermediate_size=args.intermediate * 8, moe_intermediate_size=args.intermediate,
                            num_experts=args.experts, num_experts_per_tok=args.topk, norm_topk_prob=True,
                            decoder_sparse_step=1, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    start = time.time()
    model = tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.config.architectures = ["Qwen3MoeForCausalLM"]
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    del model
    return {"parameters": params, "build_s": round(time.time() - start, 1),
            "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim", "num_experts",
                                                    "num_experts_per_tok", "moe_intermediate_size")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/moe_scale")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--precisions", default="fp8,int4_awq,nvfp4")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per precision")
    ap.add_argument("overrides", nargs="*", help="extra quantlab overrides")
    args = ap.parse_args()
    out = Path(args.out)
    model_dir = out / "model"
    info = build(model_dir, args)
    print(json.dumps(info), flush=True)
    rows = []
    for precision in args.precisions.split(","):
        run_dir = out / "runs" / precision
        cmd = [sys.executable, "-m", "quantlab", f"+precision={precision}", f"model.path={model_dir}",
               f"cache_dir={out / 'cache'}", f"hydra.run.dir={run_dir}", *args.overrides]
        start = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
            code, err = proc.returncode, (proc.stderr or "").strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            code, err = None, [f"timed out after {args.timeout} s"]
        row = {"precision": precision, "exit": code, "wall_s": round(time.time() - start, 1)}
        metrics = run_dir / "metrics.json"
        if metrics.is_file():
            doc = json.loads(metrics.read_text())
            run = doc.get("run", {})
            record = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
            counts = [c for layer in ((run.get("experts") or {}).get("tokens") or {}).values() for c in layer]
            row.update(verdict="PASS" if doc["gate"]["passed"] else "FAIL", stage_s=record.get("stage_seconds"),
                       experts_calibrated=sum(1 for c in counts if c > 0), experts=len(counts),
                       min_expert_tokens=min(counts) if counts else None,
                       router_topk_agreement=(doc["metrics"].get("router_topk_agreement") or {}).get("value"),
                       audit=(run.get("audit") or {}).get("passed"),
                       export_bytes=(run.get("checkpoint") or {}).get("safetensors_bytes"))
        else:
            row["error"] = " | ".join(err)
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "moe_scale.json").write_text(json.dumps({"model": info, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
