"""Does AutoQuantize's sensitivity rank layer groups the way a measurement does (issue "search", point 2)?

The search ranks where precision is spent by ModelOpt AutoQuantize's gradient scores (a Fisher / second-order Taylor
estimate of the loss increase when one layer group alone takes a format). This bench measures the same quantity
directly on the same calibrated fake-quant model: every group in turn alone at each format (all other groups
unquantized), the increase of mean NLL over held-out text (WikiText-2 test windows, not the scoring data), and
reports
- Spearman's rank correlation between AutoQuantize's score and the measured dNLL, per format, and for the
  upgrade the frontier orders by (score saved per bit: int4 -> fp8);
- additivity: for candidates along the search's frontier, the measured dNLL of the whole configuration against the
  sum of the groups' measured dNLLs and against AutoQuantize's predicted score (Pearson / Spearman over candidates).

    HF_HUB_OFFLINE=1 python bench/sensitivity_check.py [--data ../shared/data/wikitext-2-raw] [--windows 8]

On a CPU each forward of the windows takes seconds (2 x 120 groups of the default model: use --windows 2 there);
on a GPU the whole check takes a minute. Writes bench/results/sensitivity_check.{md,json} (or --out DIR).
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


def _setup() -> argparse.Namespace:
    """The command line, offline mode and quiet library logs."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "wikitext-2-raw"))
    ap.add_argument("--cache", default="/tmp/searchbench_cache")
    ap.add_argument("--windows", type=int, default=8, help="held-out 512-token windows per measurement")
    ap.add_argument("--candidates", type=int, default=12, help="frontier candidates for the additivity check")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("overrides", nargs="*", help="extra quantlab overrides (e.g. device=cuda)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("transformers", "modelopt", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return args


def main() -> None:
    args = _setup()
    import numpy as np
    import torch
    from modelopt.torch.opt.utils import get_hparam
    from scipy import stats as sps

    from quantlab import api
    from quantlab.graph import Executor
    from quantlab.models import quantized_in_dims
    from quantlab.pipeline import context
    from quantlab.search.checks import choices_for
    from quantlab.search.frontier import frontier
    from quantlab.search.sensitivity import Sensitivity
    from quantlab.search.sensitivity import mean_nll as model_nll
    from quantlab.stages import data, prepare

    data_dir = Path(args.data)
    overrides = ["+search=cheapest", f"cache_dir={args.cache}", f"calib.path={data_dir / 'wiki.valid.raw'}",
                 "calib.num_samples=16", "calib.seq_len=256", "calib.batch_size=16",
                 f"eval.path={data_dir / 'wiki.test.raw'}", "eval.seq_len=512", "search.int4_block_sizes=[]",
                 *args.overrides]
    cfg = api.config(overrides)
    ctx = context(cfg)
    r = Executor(ctx, [prepare.step(ctx), data.step(ctx, data.CALIB), data.step(ctx, data.EVAL)])
    choices = choices_for(cfg, quantized_in_dims(r.value("prepare")))
    by_name = {c.name: c for c in choices}
    sens = Sensitivity(cfg, ctx, r, choices)
    t0 = time.time()
    groups, fixed_params, scores_doc = sens.load()
    sens.ensure_model()
    calib_s = time.time() - t0
    model = sens.model
    device = model.get_input_embeddings().weight.device
    tokens = r.value("data:eval").tokens[: args.windows].to(device)
    formats = [c.name for c in choices if c.precision is not None]

    def set_all(assignment: dict[str, str]) -> None:
        for g in groups:
            get_hparam(model, g.leader).active = sens.recipes[assignment[g.leader]]

    batches = torch.split(tokens, 4)  # a batch per forward (one window at a time is launch-bound on a GPU)

    def mean_nll() -> float:
        return model_nll(model, batches)

    none = {g.leader: "none" for g in groups}
    t1 = time.time()
    set_all(none)
    ref = mean_nll()
    measured = {f: [] for f in formats}
    for g in groups:
        for f in formats:
            get_hparam(model, g.leader).active = sens.recipes[f]
            measured[f].append(mean_nll() - ref)
        get_hparam(model, g.leader).active = sens.recipes["none"]
    per_group_s = time.time() - t1
    rows = {}
    for f in formats:
        score = [g.scores[f] for g in groups]
        rho, p = sps.spearmanr(score, measured[f])
        rows[f] = {"spearman": float(rho), "p": float(p), "groups": len(groups),
                   "measured_dnll_sum": float(sum(measured[f])), "score_sum": float(sum(score))}
    if len(formats) >= 2:  # the move the frontier orders: cheapest -> next format, score saved per group
        a, b = formats[0], formats[1]
        rho, p = sps.spearmanr([g.scores[a] - g.scores[b] for g in groups],
                               [ma - mb for ma, mb in zip(measured[a], measured[b], strict=True)])
        rows[f"{a} -> {b} (saved)"] = {"spearman": float(rho), "p": float(p), "groups": len(groups)}
    # additivity along the frontier
    chain = frontier(groups, by_name, cfg.search.cost, fixed_params)
    picks = sorted({int(round(i)) for i in np.linspace(0, len(chain) - 2, args.candidates)})
    index = {g.leader: i for i, g in enumerate(groups)}
    add_rows = []
    for k in picks:
        cand = chain[k]
        set_all(cand.assignment)
        whole = mean_nll() - ref
        summed = sum(measured[f][index[leader]] for leader, f in cand.assignment.items() if f != "none")
        add_rows.append({"k": k, "bits": cand.bits, "aq_bits": cand.aq_bits, "predicted_score": cand.predicted,
                         "sum_of_measured": summed, "measured": whole})
    set_all(none)
    whole = [x["measured"] for x in add_rows]
    additivity = {
        "pearson_measured_vs_sum": float(sps.pearsonr([x["sum_of_measured"] for x in add_rows], whole)[0]),
        "spearman_measured_vs_predicted": float(sps.spearmanr([x["predicted_score"] for x in add_rows], whole)[0]),
        "pearson_measured_vs_predicted": float(sps.pearsonr([x["predicted_score"] for x in add_rows], whole)[0]),
    }
    lines = [f"AutoQuantize scores vs measured dNLL per layer group ({len(groups)} groups, {args.windows} x 512 "
             "held-out tokens of WikiText-2 test, each group alone at the format, the rest unquantized)", "",
             "| format | Spearman rho | p | sum of measured dNLL | sum of scores |", "|---|---|---|---|---|"]
    for f, row in rows.items():
        nan = float("nan")
        lines.append(f"| {f} | {row['spearman']:.3f} | {row['p']:.2g} | {row.get('measured_dnll_sum', nan):.4f} "
                     f"| {row.get('score_sum', nan):.4g} |")
    lines += ["", "| frontier k | bits | AQ bits | predicted score | sum of measured | measured whole |",
              "|---|---|---|---|---|---|"]
    for x in add_rows:
        lines.append(f"| {x['k']} | {x['bits']:.3f} | {x['aq_bits']:.3f} | {x['predicted_score']:.4g} | "
                     f"{x['sum_of_measured']:.4f} | {x['measured']:.4f} |")
    lines += ["", json.dumps(additivity)]
    summary = {"calibration_s": round(calib_s, 1), "measurement_s": round(per_group_s, 1),
               "device": str(device), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "torch": torch.__version__}
    text = "\n".join(lines) + "\n\n" + json.dumps(summary) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sensitivity_check.md").write_text(text)
    (out / "sensitivity_check.json").write_text(json.dumps(
        {"per_format": rows, "additivity": additivity, "frontier": add_rows, "summary": summary,
         "measured": measured, "scores": {f: [g.scores[f] for g in groups] for f in formats},
         "groups": [g.leader for g in groups]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
