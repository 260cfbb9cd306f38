"""Calibration of the gate's checks by simulation: type-I error and power of the sequential design.

For every check kind the gate has (a mean over windows of per-position values: dNLL for ppl_ratio, top-1
agreement, KL; a percentile tested as an exceedance share), S simulated paired datasets are drawn with
- tokens inside a window correlated (AR(1), rho 0.6: the within-window dependence a window-clustered interval
  must respect) and windows independent,
- the true value exactly on the threshold (type-I error: the share of PASS must be alpha), or better than the
  threshold by the design's minimum detectable effect at the cap (power: the share of PASS must be >= 1 - beta).
The decisions are made exactly as quantlab.gate.checks makes them (quantlab.gate.stats.decide at each look, stop when
decided, undecided at the cap = FAIL). A naive interval that treats tokens as independent is run beside it to show
what ignoring the dependence costs. With --pool METRICS_JSON the window values are resampled from a real run
instead (per-window dNLL / agreement / KL, shifted onto the threshold).

    python bench/gate_calibration.py --sims 10000 [--looks 8 --cap 64 --alpha 0.05 --beta 0.2] [--pool metrics.json]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np


def windows_ar1(rng, sims: int, n: int, t: int, mean: float, sd_token: float, rho: float, dist: str) -> np.ndarray:
    """Per-window means [sims, n] of AR(1) token series (marginal sd sd_token) around `mean`; dist shapes the
    window effect (normal, or lognormal for a skewed, KL-like metric)."""
    e = rng.standard_normal((sims, n, t))
    x = np.empty_like(e)
    x[..., 0] = e[..., 0]
    for i in range(1, t):
        x[..., i] = rho * x[..., i - 1] + math.sqrt(1 - rho * rho) * e[..., i]
    tokens = x * sd_token
    if dist == "lognormal":  # skewed per-window level, mean-preserving
        level = rng.lognormal(0.0, 0.6, (sims, n, 1))
        tokens = tokens + (level / math.exp(0.18) - 1.0) * abs(mean) * 0.5
    return mean + tokens.mean(-1), mean + tokens.reshape(sims, -1)


def windows_exceedance(rng, sims: int, n: int, t: int, rate: float, shape: float = 0.5) -> tuple[np.ndarray, None]:
    """Per-window shares of positions above a KL threshold [sims, n]: per-window rates vary (Beta(shape, .),
    mean `rate`: clustered exceedances; shape 0.5 is extreme clustering), positions Bernoulli within a window."""
    r = rng.beta(shape, shape * (1 - rate) / rate, (sims, n))
    return rng.binomial(t, r) / t, None


def chunked(gen, sims: int, chunk: int = 2000):
    """Draw in chunks (memory), concatenated."""
    parts = [gen(min(chunk, sims - i)) for i in range(0, sims, chunk)]
    first = np.concatenate([p[0] for p in parts])
    second = None if parts[0][1] is None else np.concatenate([p[1] for p in parts])
    return first, second


def run_design(values: np.ndarray, threshold: float, higher_is_better: bool, design) -> dict:
    """Vectorized sequential decisions over simulated datasets: quantlab.gate.stats.interval at each look, the rule of
    quantlab.gate.stats.decide (which the gate calls for every window-mean check, exceedance shares included)."""
    from quantlab.gate import stats

    sims = values.shape[0]
    verdict = np.zeros(sims, dtype=np.int8)  # 0 undecided, 1 pass, -1 fail
    stop = np.full(sims, design.cap)
    for k, n in enumerate(design.looks):
        _, lo, hi, _ = stats.interval(values[:, :n], design.t_boundary(k, n))
        if higher_is_better:
            passed, failed = lo >= threshold, hi < threshold
        else:
            passed, failed = hi <= threshold, lo > threshold
        open_ = verdict == 0
        verdict[open_ & passed] = 1
        verdict[open_ & failed & ~passed] = -1
        stop[open_ & (passed | failed)] = n
    return {"pass": float((verdict == 1).mean()), "fail": float((verdict == -1).mean()),
            "undecided_at_cap": float((verdict == 0).mean()), "mean_windows": float(stop.mean())}


def naive_token_test(tokens: np.ndarray, threshold: float, alpha: float) -> float:
    """PASS share of a fixed-n one-sided z-test that treats every token as independent (what not to do)."""
    from scipy import stats

    n = tokens.shape[1]
    mean, se = tokens.mean(1), tokens.std(1, ddof=1) / math.sqrt(n)
    return float((mean + stats.norm.isf(alpha) * se <= threshold).mean())


def mc_interval(p: float, sims: int) -> str:
    half = 1.96 * math.sqrt(max(p * (1 - p), 1e-12) / sims)
    return f"{p:.4f} ± {half:.4f}"


def main() -> None:
    from quantlab.gate import stats

    ap = argparse.ArgumentParser()
    ap.add_argument("--sims", type=int, default=10000)
    ap.add_argument("--looks", type=int, default=8, help="windows per look")
    ap.add_argument("--cap", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per window in the AR(1) simulation")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--beta", type=float, default=0.2)
    ap.add_argument("--spending", default="pocock")
    ap.add_argument("--pool", help="a metrics.json whose per-window values to resample")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate-shape", type=float, default=2.0,
                    help="Beta shape of per-window exceedance rates (smaller = more clustered; 0.5 is extreme)")
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    start = time.time()
    designs = {"sequential": stats.make_design(args.cap, args.looks, args.alpha, args.beta, True, args.spending),
               "fixed": stats.make_design(args.cap, args.looks, args.alpha, args.beta, False)}
    # check kinds: (name, threshold, higher_is_better, token sd or exceedance cluster shape, distribution); the
    # last two are stress cases (a p95 check, and exceedances in extreme clusters), reported beside the others
    kinds = [("ppl_ratio (dNLL <= log 1.10)", math.log(1.10), False, 0.6, "normal"),
             ("top1_agreement >= 0.80", 0.80, True, 0.4, "normal"),
             ("kl_mean <= 0.25", 0.25, False, 0.5, "lognormal"),
             ("kl_p99 <= t (exceedance <= 0.01)", 0.01, False, args.rate_shape, "exceedance"),
             ("kl_p95 <= t (exceedance <= 0.05)", 0.05, False, args.rate_shape, "exceedance"),
             ("kl_p99, extreme clusters (shape 0.5)", 0.01, False, 0.5, "exceedance")]
    pool = None
    if args.pool:
        doc = json.loads(open(args.pool).read())
        w = doc["windows"]
        pool = {"ppl_ratio (dNLL <= log 1.10)": np.asarray(w["dnll"]), "top1_agreement >= 0.80":
                np.asarray(w["top1_agreement"]), "kl_mean <= 0.25": np.asarray(w["kl_mean"])}
    rows = []
    for name, threshold, hib, sd, dist in kinds:
        for design_name, design in designs.items():
            sims = args.sims
            if pool is not None and name in pool:
                base = pool[name] - pool[name].mean()
                null, tokens = threshold + rng.choice(base, (sims, args.cap)), None
            elif dist == "exceedance":
                null, tokens = chunked(lambda m, threshold=threshold, sd=sd: windows_exceedance(
                    rng, m, args.cap, args.tokens * 8, threshold, sd), sims)
            else:
                null, tokens = chunked(lambda m, threshold=threshold, sd=sd, dist=dist:
                                       windows_ar1(rng, m, args.cap, args.tokens, threshold, sd, 0.6, dist), sims)
            k = len(design.looks) - 1  # the MDE the gate reports at the cap (stats.mde), averaged over the datasets
            c = design.t_boundary(k, args.cap)
            mean, lo, hi, se = stats.interval(null, c)
            mde = float(np.mean(stats.mde(mean, lo, hi, se, hib, c, design.t_beta(args.cap, c))))
            shift = mde if hib else -mde
            alt = null + shift
            if dist == "exceedance":  # the alternative drawn at the lower rate (a shifted share could go negative)
                alt = chunked(lambda m, r=max(threshold - mde, 1e-4), sd=sd: windows_exceedance(
                    rng, m, args.cap, args.tokens * 8, r, sd), sims)[0]
            r0, r1 = run_design(null, threshold, hib, design), run_design(alt, threshold, hib, design)
            row = {"check": name, "design": design_name, "looks": list(design.looks), "sims": sims,
                   "type_I": r0["pass"], "power_at_mde": r1["pass"], "mde": mde,
                   "mean_windows_null": r0["mean_windows"], "mean_windows_alt": r1["mean_windows"],
                   "source": "pool" if pool is not None and name in pool else f"AR(1) rho 0.6, {dist}"}
            if tokens is not None and design_name == "fixed" and not hib:
                row["naive_token_type_I"] = naive_token_test(tokens[:2000], threshold, args.alpha)
            rows.append(row)
            print(f"{name:37s} {design_name:10s} type-I {mc_interval(row['type_I'], sims)}  "
                  f"power at MDE {mc_interval(row['power_at_mde'], sims)}  (MDE {mde:.4g}; mean windows "
                  f"{row['mean_windows_null']:.1f} at the threshold, {row['mean_windows_alt']:.1f} at the MDE)"
                  + (f"  naive token-level test type-I {row['naive_token_type_I']:.3f}" if "naive_token_type_I" in row
                     else ""), flush=True)
    print(f"{len(rows)} rows, {args.sims} simulated datasets each, alpha {args.alpha}, beta {args.beta}, "
          f"{time.time() - start:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
