"""Tokens to verdict, sequential vs fixed-n, and paired vs unpaired interval widths, on the default model.

The sweep fp8 / int8_sq / int4_awq x kv none / fp8 on WikiText-2 test (512-token windows up to the default cap,
eval.max_windows, looks of 8, default gate and calibration; articles as documents: eval.doc_separator), or with
--data pydoc on the default evaluation text, each run exactly as `python -m quantlab` runs it.

- Sequential: the windows each run used before every gate check was decided (metrics.json design.windows_used).
- Fixed-n with the same alpha / beta and the same MDE: the sequential design's MDE at its cap is
  (z_final + z_beta) sigma / sqrt(cap), with z_final its last (alpha-spending) boundary; a fixed design reaches that
  MDE at n_fixed = cap ((z_alpha + z_beta) / (z_final + z_beta))^2 windows. The ratio n_fixed / windows_used is
  reported per run, and its median (target >= 3).
- Paired vs unpaired: the 95% interval of the ppl ratio from the per-window paired differences (what the gate uses)
  against the Welch interval of the difference of the two models' mean NLL as if they had been scored on unrelated
  text; top-1 agreement: the window-clustered interval against a token-level Wilson interval that ignores the
  dependence inside a window. Both at the windows the run used.

    HF_HUB_OFFLINE=1 python bench/tokens_to_verdict.py [--data ../shared/data/wikitext-2-raw | pydoc] [--cache DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "wikitext-2-raw"))
    ap.add_argument("--cache", default="/tmp/ttv_cache")
    ap.add_argument("--out", default="/tmp/ttv_runs")
    ap.add_argument("--runs", default="fp8:none,fp8:fp8,int8_sq:none,int8_sq:fp8,int4_awq:none,int4_awq:fp8",
                    help="precision:kv pairs to run; rows already in OUT/rows.jsonl are kept (a sweep can resume)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import numpy as np
    from scipy import stats as sps

    from quantlab import api
    from quantlab.gate.stats import wilson_interval, z

    ledger = Path(args.out) / "rows.jsonl"
    ledger.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if ledger.is_file():
        for line in ledger.read_text().splitlines():
            done[json.loads(line)["run"]] = json.loads(line)
    for pair in args.runs.split(","):
        precision, kv = pair.split(":")
        if f"{precision} kv={kv}" in done:
            continue
        run_dir = Path(args.out) / f"{precision}_{kv}"
        t0 = time.time()
        data = [] if args.data == "pydoc" else [f"eval.path={Path(args.data) / 'wiki.test.raw'}",
                                                "eval.doc_separator='^ = [^=].* = $'"]
        res = api.run([f"+precision={precision}", f"kv_cache={kv}", f"cache_dir={args.cache}", *data], run_dir)
        wall = time.time() - t0
        doc = res.doc
        design = doc["gate"]["design"]
        used, cap = design["windows_used"], design["cap"]
        z_final = design["boundaries_z"][-1]
        z_a, z_b = z(1 - design["alpha"]), z(1 - design["beta"])
        n_fixed = cap * ((z_a + z_b) / (z_final + z_b)) ** 2
        w = doc["windows"]
        n = used
        ref, cand = np.array(w["nll_reference"][:n]), np.array(w["nll_candidate"][:n])
        d = cand - ref
        tq = sps.t.ppf(0.975, n - 1)
        paired = 2 * tq * d.std(ddof=1) / math.sqrt(n)
        welch_se = math.sqrt(ref.var(ddof=1) / n + cand.var(ddof=1) / n)
        unpaired = 2 * sps.t.ppf(0.975, 2 * n - 2) * welch_se
        mean_d = d.mean()
        ppl_paired = math.exp(mean_d + paired / 2) - math.exp(mean_d - paired / 2)
        ppl_unpaired = math.exp(mean_d + unpaired / 2) - math.exp(mean_d - unpaired / 2)
        agree = np.array(w["top1_agreement"][:n])
        npred = np.array(w["n_pred"][:n]) if isinstance(w["n_pred"], list) else np.full(n, w["n_pred"])
        clustered = 2 * tq * agree.std(ddof=1) / math.sqrt(n)
        lo, hi = wilson_interval(float((agree * npred).sum()), int(npred.sum()))  # as if tokens were independent
        wilson = hi - lo
        row = {"run": f"{precision} kv={kv}", "exit": res.exit_code, "verdict": "PASS" if res.passed else "FAIL",
               "windows_used": used, "cap": cap, "n_fixed_same_mde": round(n_fixed, 1),
               "undecided_at_cap": any("undecided at the cap" in c.get("detail", "") for c in doc["gate"]["checks"]),
               "checks": {c["name"]: [c["verdict"], c.get("clusters"), c.get("icc"), c.get("design_effect")]
                          for c in doc["gate"]["checks"]},
               "ratio_fixed_over_sequential": round(n_fixed / used, 2), "wall_s": round(wall, 1),
               "ppl_ratio": doc["metrics"]["ppl_ratio"]["value"], "ppl_ci_width_paired": ppl_paired,
               "ppl_ci_width_unpaired": ppl_unpaired, "top1": doc["metrics"]["top1_agreement"]["value"],
               "top1_ci_width_clustered": clustered, "top1_ci_width_token_wilson": wilson}
        done[row["run"]] = row
        with ledger.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    rows = list(done.values())
    ratios = [r["ratio_fixed_over_sequential"] for r in rows]
    lines = ["| run | verdict | windows used / cap | fixed-n, same MDE | fixed / sequential | ppl ratio | ppl CI width "
             "paired / unpaired | top-1 | top-1 CI width clustered / token-level | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['verdict']} | {r['windows_used']} / {r['cap']} | {r['n_fixed_same_mde']} | "
                     f"{r['ratio_fixed_over_sequential']}x | {r['ppl_ratio']:.4f} | {r['ppl_ci_width_paired']:.4f} / "
                     f"{r['ppl_ci_width_unpaired']:.4f} | {r['top1']:.4f} | {r['top1_ci_width_clustered']:.4f} / "
                     f"{r['top1_ci_width_token_wilson']:.4f} | {r['wall_s']} |")
    text = "\n".join(lines) + f"\n\nmedian fixed / sequential: {statistics.median(ratios):.2f}x\n"
    print(text)
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "tokens_to_verdict.md").write_text(text)
    (out / "tokens_to_verdict.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
