"""+search=cheapest against AutoQuantize's own budget, on the default model, with one gate for both.

Setup (issue "Search"): default model (SmolLM2-135M-Instruct), calibration 16 x 256 tokens of WikiText-2 valid,
evaluation WikiText-2 test at 512 tokens (the sequential gate, cap --max-windows windows), the default gate's base
thresholds applied to every configuration (gate.per_precision off: one quality bar).

1. The search, as a user runs it (`python -m quantlab +search=cheapest ...`, in-process through the search driver,
   as quantlab.api runs it, so that its calibrated model can be handed on to step 2):
   formats int4_awq / fp8 / none per layer group, int4 at the model's block (64) and at --block-sizes (default none;
   per-layer group size is a dimension AutoQuantize does not search; 128 does not divide this model's 576 inputs),
   cost = stored bits, sensitivity --sensitivity (AutoQuantize's gradient scores, or measured). Wall time,
   evaluations, tokens, the winner.
2. AutoQuantize over its own formats (INT4-AWQ at the model's block, FP8, none), calibrated on the same data (its
   per-format calibration and gradient scores; the search's own sensitivity, calibrated model included, when it
   used the same): its
   own pick (`_resolve_best_recipe`, its LP over its scores and costs) at
   an effective-bits budget, exported and judged by the same gate on the exported checkpoint:
   - at the winner's AutoQuantize bits;
   - its cheapest passing budget, by bisection on its budget between uniform INT4 and uniform FP8 to --resolution
     bits (each probe a full evaluation).
   Uniform int4_awq and uniform fp8 come from the search (or are evaluated here when the search did not need them).

    HF_HUB_OFFLINE=1 python bench/search_bench.py [--data ../shared/data/wikitext-2-raw] [--cache DIR]

Prints one table (both bit accountings) and writes bench/results/search.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def autoquantize_sensitivity(overrides: list[str], searched):
    """(config, choices, Sensitivity) of AutoQuantize over its own formats. When that is the sensitivity the search
    used (same model, data and formats: `searched`, the search's), the search's object is handed on, calibrated model
    included; a new Sensitivity would calibrate again (same result, minutes on this model)."""
    from quantlab import api
    from quantlab.graph import Executor
    from quantlab.models import quantized_in_dims
    from quantlab.pipeline import context
    from quantlab.search.checks import choices_for
    from quantlab.search.sensitivity import Sensitivity
    from quantlab.stages import data, prepare

    cfg = api.config(overrides)
    ctx = context(cfg)
    r = Executor(ctx, [prepare.step(ctx), data.step(ctx, data.CALIB), data.step(ctx, data.EVAL)])
    choices = choices_for(cfg, quantized_in_dims(r.value("prepare")))
    sens = Sensitivity(cfg, ctx, r, choices)
    return cfg, choices, (searched if sens.key() == searched.key() else sens)


def _setup() -> argparse.Namespace:
    """The command line, offline mode and quiet library logs."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "wikitext-2-raw"))
    ap.add_argument("--cache", default="/tmp/searchbench_cache")
    ap.add_argument("--out", default="/tmp/searchbench_runs")
    ap.add_argument("--max-windows", type=int, default=64)
    ap.add_argument("--resolution", type=float, default=0.25, help="bisection resolution, AutoQuantize bits")
    ap.add_argument("--block-sizes", default="[]", help="search.int4_block_sizes")
    ap.add_argument("--sensitivity", default="autoquantize", help="search.sensitivity (autoquantize | measured)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("transformers", "modelopt", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    return args


def main() -> None:
    args = _setup()
    from quantlab.compose import compose
    from quantlab.search import driver
    from quantlab.search.candidates import evaluate_candidate
    from quantlab.search.frontier import Candidate, totals
    from quantlab.search.frontier import uniform as uniform_candidate

    data_dir = Path(args.data)
    common = [f"cache_dir={args.cache}",
              f"calib.path={data_dir / 'wiki.valid.raw'}", "calib.num_samples=16", "calib.seq_len=256",
              "calib.batch_size=16", f"eval.path={data_dir / 'wiki.test.raw'}", "eval.seq_len=512",
              f"eval.max_windows={args.max_windows}"]
    overrides = ["+search=cheapest", *common, f"search.int4_block_sizes={args.block_sizes}",
                 f"search.sensitivity={args.sensitivity}"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "search"
    print("$ python -m quantlab " + " ".join(overrides), flush=True)
    t0 = time.time()
    search_cfg, snapshot = compose(overrides)
    searched = driver.open_search(search_cfg, run_dir.resolve(), snapshot, overrides)  # what api.run does, in 2 steps
    result = driver.search(searched)
    search_s = time.time() - t0
    doc = json.loads((run_dir / "search.json").read_text())
    print(f"search: exit {result.exit_code} in {search_s:.0f} s, {doc['evaluations_used']} evaluations", flush=True)

    # ---- AutoQuantize's own picks, same calibration data, same gate: AutoQuantize over its own formats (INT4-AWQ at
    # the model's block, FP8, none), the search's sensitivity artifact when the search used the same formats
    aq_overrides = ["+search=cheapest", *common, "search.int4_block_sizes=[]", "search.sensitivity=autoquantize"]
    cfg, choices, sens = autoquantize_sensitivity(aq_overrides, searched.sens)
    groups, fixed_params, scores_doc = sens.load()
    by_name = {c.name: c for c in choices}
    aq_int4 = next(c.name for c in choices if c.precision == "int4_awq")  # AutoQuantize's INT4: the model's block
    t1 = time.time()

    def candidate(label: str, assignment: dict) -> Candidate:
        assignment = {g.leader: assignment[g.leader] for g in groups}
        bits, aq, pred = totals(groups, by_name, assignment, fixed_params)
        return Candidate(label, assignment, bits, aq, pred)

    def judged(cand: Candidate) -> dict:
        ev = evaluate_candidate(cfg, sens, cand, "none", out / "autoquantize", [])
        row = ev.row()
        print(f"  {cand.label}: {cand.aq_bits:.3f} AQ bits, {cand.bits:.3f} stored -> {row['verdict']} "
              f"(ppl ratio {row['metrics']['ppl_ratio']['value']:.4f}, "
              f"top-1 {row['metrics']['top1_agreement']['value']:.4f})",
              flush=True)
        return row

    def aq_at(bits: float) -> dict:
        pick = sens.autoquantize_pick(bits)
        # AutoQuantize chooses among its own formats only: INT4 at the model's block, FP8, none
        return judged(candidate(f"AutoQuantize @{bits:.2f}", pick))

    uniform = {}
    for name in (aq_int4, "fp8"):
        hit = next((r_ for r_ in doc["evaluations"]
                    if r_["formats"] == {name: len(groups)} and r_["kv_cache"] == "none"),
                   None)
        uniform[name] = hit or judged(uniform_candidate(groups, by_name, name, fixed_params))
    winner = doc["winner"]
    aq_winner_bits = aq_at(winner["aq_bits"]) if winner else None
    lo, hi = uniform[aq_int4]["aq_bits"], uniform["fp8"]["aq_bits"]
    probes = []
    if uniform[aq_int4]["verdict"] == "PASS":
        hi = lo
    while hi - lo > args.resolution:
        mid = round((lo + hi) / 2, 3)
        row = aq_at(mid)
        probes.append(row)
        if row["verdict"] == "PASS":
            hi = min(hi, row["aq_bits"])
        else:
            lo = mid
    cheapest_aq = min((p for p in probes if p["verdict"] == "PASS"), key=lambda p: p["aq_bits"], default=None)
    aq_s = time.time() - t1

    table = [(f"uniform int4_awq (block {aq_int4.split('@')[-1]})", uniform[aq_int4]),
             ("uniform fp8", uniform["fp8"])]
    if winner:
        table.append(("quantlab search winner", winner))
    if aq_winner_bits:
        table.append(("AutoQuantize at the winner's AQ bits", aq_winner_bits))
    if cheapest_aq:
        table.append(("AutoQuantize, cheapest passing budget", cheapest_aq))
    for p in probes:
        if p is not cheapest_aq:
            table.append(("AutoQuantize bisection probe", p))
    lines = ["| configuration | AQ bits | stored bits | stored, measured | ppl ratio [95% CI] | top-1 | KL | windows "
             "| verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in table:
        m = row["metrics"]
        ci = m["ppl_ratio"].get("ci") or [float("nan")] * 2
        lines.append(f"| {name} | {row['aq_bits']:.3f} | {row['bits']:.3f} | {row.get('stored_bits_measured')} | "
                     f"{m['ppl_ratio']['value']:.4f} [{ci[0]:.4f}, {ci[1]:.4f}] | {m['top1_agreement']['value']:.4f} | "
                     f"{m['kl_mean']['value']:.4f} | {row['windows']} | {row['verdict']} |")
    summary = {
        "search_wall_s": round(search_s, 1), "search_evaluations": doc["evaluations_used"],
        "search_tokens": doc["tokens_used"], "sensitivity_s": scores_doc["seconds"],
        "winner": winner and {k: winner[k] for k in ("label", "bits", "aq_bits", "kv_cache", "formats")},
        "autoquantize_cheapest_passing_aq_bits": cheapest_aq and cheapest_aq["aq_bits"],
        "autoquantize_bisection_bracket": [lo, hi], "autoquantize_probes": len(probes),
        "autoquantize_wall_s": round(aq_s, 1), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python -m quantlab " + " ".join(overrides),
    }
    text = "\n".join(lines) + "\n\n" + json.dumps(summary, indent=2)
    print(text)
    res = REPO / "bench" / "results"
    res.mkdir(exist_ok=True)
    (res / "search.md").write_text(text + "\n")
    (res / "search.json").write_text(json.dumps({"summary": summary, "table": [{"name": n, **r_} for n, r_ in table],
                                                 "search": doc}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
