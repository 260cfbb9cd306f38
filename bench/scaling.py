"""Scaling of the default sweep (fp8, int8_sq, int4_awq): wall time vs evaluation tokens and vs model size.

A: the default model with its calibration done once beforehand (timed separately), then the sweep at 4 eval
   sizes; each size also records what `--plan` predicted for it from the cost records of the earlier builds.
B: random Llama-shaped models of increasing width (4 layers, the default model's tokenizer), each swept
   cold with fixed calibration and eval sizes; one cache, so each width's plan predicts from the narrower ones.
Every sweep is the real CLI in a subprocess. Writes scaling.json, scaling.md and scaling.png to --out.

    python bench/scaling.py --out bench/results/cpu-2026-11-29 [--sizes 4,8,16,32] [--widths 128,256,512,1024]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRECISIONS = "+precision=fp8,int8_sq,int4_awq"


def quantlab(args: list[str], cwd: Path, cache: Path) -> tuple[float, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "QUANTLAB_CACHE": str(cache), "PYTHONWARNINGS": "ignore"}
    start = time.time()
    res = subprocess.run([sys.executable, "-m", "quantlab", *args], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if res.returncode not in (0, 1):  # 1: a gate failed, which is a result, not a bench failure
        raise SystemExit(f"quantlab {' '.join(args)} exited {res.returncode}:\n{res.stderr[-3000:]}")
    return wall, res.stdout


def predicted(stdout: str) -> float | None:
    """The plan's total ('about 2.3min' / 'about 41s') from the sweep's own printout; None when some stage to
    build had no earlier build to predict from (the total would leave it out)."""
    m = re.search(r"about ([\d.]+)(min|s) run one after another", stdout)
    if not m or "no earlier build on this machine to predict from" in stdout:
        return None
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


def complete(rows: list[dict]) -> list[dict]:
    """Rows whose plan covered every stage (results written before predicted() returned None for partial
    plans: the first row of each part had a cold cache, so nothing to predict from)."""
    return [r for i, r in enumerate(rows) if r["plan_predicted_s"] is not None and i > 0]


def stage_totals(sweep_dir: Path) -> dict[str, float]:
    totals: dict[str, float] = {}
    for run in sorted(sweep_dir.glob("*/run.json")):
        for stage, secs in json.loads(run.read_text())["stage_seconds"].items():
            key = "evaluate" if stage.startswith("evaluate") else stage
            totals[key] = round(totals.get(key, 0.0) + secs, 2)
    return totals


def make_model(out: Path, width: int, tokenizer_dir: Path) -> int:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    inter = (int(width * 2.75) + 127) // 128 * 128  # AWQ's default block (128) divides every dimension
    cfg = LlamaConfig(vocab_size=49152, hidden_size=width, intermediate_size=inter, num_hidden_layers=4,
                      num_attention_heads=max(1, width // 64), num_key_value_heads=max(1, width // 128),
                      max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy2(f, out / f.name)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", default="4,8,16,32", help="eval windows of --seq tokens (part A)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--calib", type=int, default=8, help="calibration windows of --seq tokens (part A)")
    ap.add_argument("--widths", default="128,256,512,1024", help="hidden sizes (part B)")
    ap.add_argument("--b-windows", type=int, default=8)
    ap.add_argument("--b-seq", type=int, default=256)
    ap.add_argument("--replot", action="store_true", help="only redraw table and plot from OUT/scaling.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        result = json.loads((args.out / "scaling.json").read_text())
        write_table(result, args)
        plot(result, args.out / "scaling.png")
        return
    result = {"machine": os.uname().nodename, "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "tokens": [],
              "widths": []}

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache_a"
        common = [f"calib.num_samples={args.calib}", f"calib.seq_len={args.seq}", f"eval.seq_len={args.seq}"]
        # A. calibration + export once (what a sweep at any eval size shares), then the eval sizes
        wall, _ = quantlab(["-m", PRECISIONS, *common, "stop_after=export", "hydra.sweep.dir=" + str(tmp / "warm")],
                           REPO, cache)
        result["calibrate_once_s"] = round(wall, 1)
        print(f"A: conversion + calibration + export of 3 precisions ({args.calib} x {args.seq}): {wall:.1f} s",
              flush=True)
        for n in [int(x) for x in args.sizes.split(",")]:
            sweep = tmp / f"a_{n}"
            wall, stdout = quantlab(["-m", PRECISIONS, *common, f"eval.max_windows={n}",
                                     "hydra.sweep.dir=" + str(sweep)], REPO, cache)
            row = {"windows": n, "eval_tokens": n * args.seq, "wall_s": round(wall, 1),
                   "plan_predicted_s": predicted(stdout), "stages": stage_totals(sweep)}
            result["tokens"].append(row)
            print(f"A: {n} x {args.seq} eval tokens: {wall:.1f} s (plan predicted {row['plan_predicted_s']}) "
                  f"{row['stages']}", flush=True)

        # B. random models of increasing width, cold, one cache
        prepared = next(cache.glob("prepare/*/config.json")).parent
        cache_b = tmp / "cache_b"
        for width in [int(x) for x in args.widths.split(",")]:
            model_dir = tmp / f"model_{width}"
            params = make_model(model_dir, width, prepared)
            sweep = tmp / f"b_{width}"
            wall, stdout = quantlab(["-m", PRECISIONS, f"model.path={model_dir}", f"calib.num_samples={args.b_windows}",
                                     f"calib.seq_len={args.b_seq}", f"eval.max_windows={args.b_windows}",
                                     f"eval.seq_len={args.b_seq}",
                                     "hydra.sweep.dir=" + str(sweep)], REPO, cache_b)
            row = {"width": width, "params": params, "wall_s": round(wall, 1), "plan_predicted_s": predicted(stdout),
                   "stages": stage_totals(sweep)}
            result["widths"].append(row)
            print(f"B: width {width} ({params / 1e6:.1f} M params): {wall:.1f} s "
                  f"(plan predicted {row['plan_predicted_s']}) {row['stages']}", flush=True)

    (args.out / "scaling.json").write_text(json.dumps(result, indent=2) + "\n")
    write_table(result, args)
    plot(result, args.out / "scaling.png")


def write_table(result: dict, args) -> None:
    lines = [f"# Scaling of the default sweep (fp8 + int8_sq + int4_awq), {result['machine']}, {result['date']}",
             "",
             f"Command: `python bench/scaling.py {' '.join(result['argv'])}` (predictions: what the sweep's plan "
             "printed before it ran, from the cost records of the earlier rows; the first row of each part had none)",
             "",
             f"A. Default model, calibration ({args.calib} x {args.seq} tokens, 3 precisions) done once beforehand: "
             f"{result['calibrate_once_s']} s", "",
             "| eval windows | eval tokens | sweep wall (s) | plan predicted (s) | reference (s) "
             "| candidate evaluations (s) |",
             "|---|---|---|---|---|---|"]
    shown = {id(r) for r in complete(result["tokens"]) + complete(result["widths"])}

    def pred(r):
        return r["plan_predicted_s"] if id(r) in shown else "- (cold cache)"

    for r in result["tokens"]:
        lines.append(f"| {r['windows']} | {r['eval_tokens']} | {r['wall_s']} | {pred(r)} | "
                     f"{r['stages'].get('reference', 0)} | {r['stages'].get('evaluate', 0)} |")
    lines += ["",
              f"B. Random Llama-shaped models, 4 layers, cold cache; calibration and eval {args.b_windows} x "
              f"{args.b_seq} tokens",
              "",
              "| width | params (M) | sweep wall (s) | plan predicted (s) | quantize (s) | export (s) | reference (s) "
              "| candidate evaluations (s) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["widths"]:
        s = r["stages"]
        lines.append(f"| {r['width']} | {r['params'] / 1e6:.1f} | {r['wall_s']} | {pred(r)} | {s.get('quantize', 0)} | "
                     f"{s.get('export', 0)} | {s.get('reference', 0)} | {s.get('evaluate', 0)} |")
    (args.out / "scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["eval_tokens"] for r in result["tokens"]]
    a.plot(xs, [r["wall_s"] for r in result["tokens"]], "o-", label="measured")
    pred = [(r["eval_tokens"], r["plan_predicted_s"]) for r in complete(result["tokens"])]
    if pred:
        a.plot(*zip(*pred, strict=True), "x--", label="plan's prediction before the run")
    a.set(xlabel="eval tokens", ylabel="sweep wall time (s)", title="default model, calibration cached")
    a.legend()
    ps = [r["params"] / 1e6 for r in result["widths"]]
    b.plot(ps, [r["wall_s"] for r in result["widths"]], "o-", label="measured")
    pred = [(r["params"] / 1e6, r["plan_predicted_s"]) for r in complete(result["widths"])]
    if pred:
        b.plot(*zip(*pred, strict=True), "x--", label="plan's prediction (from the narrower models)")
    for r, p in zip(result["widths"], ps, strict=True):
        b.annotate(f"w={r['width']}", (p, r["wall_s"]), textcoords="offset points", xytext=(4, -10), fontsize=8)
    b.set(xlabel="parameters (M)", ylabel="sweep wall time (s)", title="random Llama models, cold cache")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
