"""The architecture matrix outside pytest: every family of the support table x precision x KV cache, each a real
run (calibration, export, audit, torch engine on the export) with eval.attribution, so the engine is compared with
ModelOpt's fake-quant model as exported on the same windows. Wall time per run.

Tiny models of each family are built from transformers configs and trained briefly on pydoc text
(tests/_builders.py's build_family). On a GPU every run uses it (bf16) and NVFP4 is included (its fake-quant
model needs CUDA); on a CPU, fp32 and NVFP4 is left out.

    HF_HUB_OFFLINE=1 python bench/family_matrix.py --out /tmp/matrix [--jobs 4] [--families llama,mixtral]
        [--precisions fp8,int4_awq] [--kv none,fp8]

Writes matrix.json and matrix.md to --out and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
FAST = ["calib.num_samples=4", "calib.seq_len=64", "calib.batch_size=2", "eval.seq_len=64", "eval.max_windows=8",
        "eval.batch_size=4", "eval.gen_prompts=2", "eval.gen_prompt_len=8", "eval.gen_tokens=6",
        "gate.statistical.look_windows=4"]


def one(family: str, precision: str, kv: str, model: Path, out: Path, cache: Path) -> dict:
    run_dir = out / "runs" / f"{family}_{precision}_{kv}"
    cmd = [sys.executable, "-m", "quantlab", f"+precision={precision}", f"kv_cache={kv}", f"model.path={model}",
           f"cache_dir={cache}", "eval.attribution=true", f"hydra.run.dir={run_dir}", *FAST]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                     "PYTHONWARNINGS": "ignore"})
    row = {"family": family, "precision": precision, "kv": kv, "exit": proc.returncode,
           "wall_s": round(time.time() - start, 1)}
    metrics = run_dir / "metrics.json"
    if metrics.is_file():
        doc = json.loads(metrics.read_text())
        att = doc.get("attribution") or {}
        kl = (att.get("metrics") or {}).get("kl_mean") or {}
        row.update(engine_vs_exported_top1=att.get("engine_vs_exported_top1"),
                   floor=att.get("exported_jitter_floor_top1"), kl_fakequant=kl.get("fakequant_exported"),
                   kl_engine=kl.get("torch"), router=(doc["metrics"].get("router_topk_agreement") or {}).get("value"),
                   verdict="PASS" if doc["gate"]["passed"] else "FAIL",
                   audit=(doc["run"].get("audit") or {}).get("passed"))
        top, floor = row["engine_vs_exported_top1"], row["floor"]
        fq, en = row["kl_fakequant"], row["kl_engine"]
        row["matches"] = bool(top is not None and top >= min(0.99, floor or 1.0) and fq is not None
                              and abs(en - fq) <= 0.1 * fq + 1e-4)
    else:
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        row.update(matches=False, error=" | ".join(tail))
    print(f"{family:12s} {precision:9s} kv={kv:4s} exit {row['exit']} "
          f"engine/fq {row.get('engine_vs_exported_top1')} floor {row.get('floor')} "
          f"KL {row.get('kl_fakequant')}/{row.get('kl_engine')} {row['wall_s']} s"
          + ("" if row.get("matches") else f"  MISMATCH {row.get('error', '')}"), flush=True)
    return row


def main() -> None:
    import torch

    from quantlab.families import FAMILIES

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/family_matrix")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--families", default="")
    ap.add_argument("--precisions", default="")
    ap.add_argument("--kv", default="none,fp8")
    args = ap.parse_args()
    from _builders import build_family, train_tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    families = [f for f in FAMILIES.values() if not args.families or f.name in args.families.split(",")]
    wanted = args.precisions.split(",") if args.precisions else None
    tok = out / "tokenizer"
    if not (tok / "tokenizer.json").is_file():
        train_tokenizer(tok)
    models = {}
    for f in families:
        target = out / "models" / f.name
        if not (target / "config.json").is_file():
            build_family(f.name, target, tok)
        models[f.name] = target
    combos = [(f.name, p, kv) for f in families for p in f.precisions if p != "mixed"
              and (wanted is None or p in wanted) and (gpu or p != "nvfp4")
              for kv in args.kv.split(",") if kv == "none" or f.kv_fp8]
    print(f"{len(combos)} runs on {'cuda: ' + torch.cuda.get_device_name(0) if gpu else 'cpu'}, {args.jobs} at a time",
          flush=True)
    start = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda c: one(*c, models[c[0]], out, out / "cache"), combos))
    total = time.time() - start
    lines = ["| family | precision | KV | exit | engine vs fake-quant (top-1) | floor | KL fake-quant / engine | "
             "router top-k | audit | wall s | matches |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['precision']} | {r['kv']} | {r['exit']} | "
                     f"{r.get('engine_vs_exported_top1')} | {r.get('floor')} | "
                     f"{r.get('kl_fakequant')} / {r.get('kl_engine')} | {r.get('router')} | "
                     f"{r.get('audit')} | {r['wall_s']} | {'yes' if r['matches'] else 'NO: ' + r.get('error', '')} |")
    summary = {"runs": len(rows), "matches": sum(r["matches"] for r in rows), "wall_s": round(total, 1),
               "device": torch.cuda.get_device_name(0) if gpu else "cpu", "jobs": args.jobs}
    text = "\n".join(lines) + "\n\n" + json.dumps(summary)
    (out / "matrix.md").write_text(text + "\n")
    (out / "matrix.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
