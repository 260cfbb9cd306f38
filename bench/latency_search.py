"""search.cost=latency: the fastest configuration that passes the gate, measured in engine=torch.

Runs the real CLI (`python -m quantlab +search=cheapest search.cost=latency ...`) in a subprocess, on
- `--model default`: the embedded default model (SmolLM2-135M-Instruct), any extra overrides appended (data, etc.);
- `--model llama8b`: a random-weight Llama with Llama-3-8B's layer shape (hidden 4096, 32 query / 8 KV heads of
  128, intermediate 14336) and --layers layers, the tests' small tokenizer, saved in bf16 (random weights: the
  quality numbers mean nothing, latencies and the latency model's accuracy do; the embeddings lead the residual stream
  (std 1, o_proj / down_proj scaled by 0.1) as in trained models, and top-1 agreement is relaxed to 0.5).
Then prints, from search.json: the latency of the unquantized model and of each uniform format, every evaluated
configuration's predicted against measured latency (the linear latency model's error), the verdicts and the
winner, and writes them to --out/latency_search.json.

    HF_HUB_OFFLINE=1 python bench/latency_search.py --model llama8b --layers 4 --out /tmp/lat [overrides...]
    HF_HUB_OFFLINE=1 python bench/latency_search.py --model default --out /tmp/lat search.latency_batch=8
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


def build_llama8b(out: Path, layers: int) -> dict:
    import torch
    import transformers as tf
    from _builders import train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():  # a residual stream led by the embeddings (std 1) with small layer updates, as trained
        # models have: random layers at full strength make FP8 flip top-1 on a third of positions (audit canary)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    model = model.to(torch.bfloat16)
    model.config.architectures = ["LlamaForCausalLM"]
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    return {"parameters": params, "layers": layers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("default", "llama8b"), default="default")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="/tmp/latency_search")
    ap.add_argument("--timeout", type=int, default=560)
    ap.add_argument("--name", default=None, help="the run's folder under --out/runs (default: --model)")
    ap.add_argument("overrides", nargs="*", help="extra quantlab overrides")
    args = ap.parse_args()
    if any(o.startswith(("hydra.run.dir", "cache_dir")) for o in args.overrides):
        ap.error("give --out / --name instead of hydra.run.dir or cache_dir")
    out = Path(args.out)
    extra, info = [], {"model": args.model}
    if args.model == "llama8b":
        model_dir = out / "model"
        if not (model_dir / "config.json").is_file():
            info.update(build_llama8b(model_dir, args.layers))
        extra = [f"model.path={model_dir}", "gate.thresholds.top1_agreement.min=0.5"]
    name = args.name or args.model
    run_dir = out / "runs" / name
    cmd = [sys.executable, "-m", "quantlab", "+search=cheapest", "search.cost=latency", f"cache_dir={out / 'cache'}",
           f"hydra.run.dir={run_dir}", *extra, *args.overrides]
    print("$ " + " ".join(cmd), flush=True)
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    wall = time.time() - start
    print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-3000:], flush=True)
    doc_path = run_dir / "search.json"
    if not doc_path.is_file():
        print(proc.stderr[-3000:])
        sys.exit(1)
    doc = json.loads(doc_path.read_text())
    lat = doc["latency"]
    none = lat["unquantized_ms"]
    print(f"{lat['batch']} x {lat['tokens']} prefill, median of {lat['repeats']}: unquantized {none:.2f} ms; " +
          ", ".join(f"uniform {n} {m['ms']:.2f} ms ({m['ms'] / none:.3f}x)" for n, m in lat["measured"].items()
                    if n != "none") + f"; not faster: {lat['not_faster']}")
    rows = []
    for r in doc["evaluations"]:
        if r["latency_ms"] is None:
            continue
        err = (r["latency_ms"] - r["latency_ms_predicted"]) / r["latency_ms"]
        rows.append({"label": r["label"], "bits": r["bits"], "predicted_ms": round(r["latency_ms_predicted"], 3),
                     "measured_ms": round(r["latency_ms"], 3), "iqr_ms": [round(v, 3) for v in r["latency_iqr_ms"]],
                     "model_error": round(err, 4), "vs_unquantized": round(r["latency_ms"] / none, 4),
                     "verdict": r["verdict"], "ppl_ratio": r["metrics"]["ppl_ratio"]["value"],
                     "top1": r["metrics"]["top1_agreement"]["value"]})
        print(f"  {r['label']:<18} {r['bits']:6.3f} bits  predicted {r['latency_ms_predicted']:8.2f} ms  measured "
              f"{r['latency_ms']:8.2f} ms ({err:+.1%})  {r['latency_ms'] / none:.3f}x  {r['verdict']}", flush=True)
    result = {**info, "exit": proc.returncode, "wall_s": round(wall, 1), "cmd": cmd[1:], "latency": lat,
              "evaluations": rows, "winner": doc["winner"] and doc["winner"]["label"],
              "frontier_candidates": len(doc["frontier"])}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"latency_search_{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"exit {proc.returncode}, {wall:.0f} s", flush=True)


if __name__ == "__main__":
    main()
