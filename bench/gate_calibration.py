"""Calibration of the gate by simulation on data shaped like real runs: type-I error and power of every check.

Each simulated gate is a paired evaluation of S windows laid out as a real evaluation text lays them out (the
documents of the windows in the look order quantlab.stages.data stores: the default pydoc text, 70 windows of 512
tokens from 26 documents (until 2026-12-07 61 windows from 10 topics: layout "pydoc_hash"); WikiText-2 test, the
first eval.max_windows (160) of 592 windows from 61 articles; or independent windows), with per-window values of
the default checks (three means, three tails) drawn jointly per document:

    value = level + sd * (sqrt(icc) * U_document + sqrt(1 - icc) * E_window)

U and E standardized gamma variables whose skewness makes the window values' skewness the row's (positive for KL and
dNLL, negative for top-1 agreement), and optionally rare bad windows (a share p of windows, scattered or whole
documents, whose loss - KL, dNLL, 1 - agreement - is m times the bulk's). For the type-I rows the checked metric's true
mean (bad windows included) sits exactly on its threshold; for power it is better than the threshold by the MDE the gate
reports at the cap. The other checks sit at healthy levels. Text-relative rows (--rows text) draw every window of the
text's pool and put the text's own mean on the threshold instead. The gate then runs as `python -m quantlab` runs it: at
every look each check is decided by quantlab.gate.stats (interval with the documents as clusters, decide's rule; the
tail checks' exact binomial boundaries), evaluation stops once the gate's verdict is known
(quantlab.gate.checks.settled: every check decided or one failed) and an undecided check at the cap fails. The decision
loop is vectorized over simulated gates with the gate's own functions (stats.interval, stats.Clusters,
stats.tail_boundaries); --verify runs quantlab.gate.checks.evaluate_checks / settled / finish on real Windows objects
for the first simulated gates of every row and asserts the same verdicts, window for window.

    python bench/gate_calibration.py --sims 4000 [--rows all|quick|bad|text|rare|table] [--verify 200]
        [--runs metrics.json ...] [--out bench/results/DIR/gate_calibration.json]

--runs measures the skewness and intra-document correlation of real runs' per-window values (metrics.json windows
with their documents) and adds them as rows.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# the default text's layout since 2026-12-07 (quantlab/stages/pydoc_text.py's groups); the earlier one (61 windows
# from 10 topics, split by a hash of the name) is kept in its layouts as "pydoc_hash" for comparison
LAYOUTS = REPO / "bench" / "results" / "cpu-2026-12-07" / "layouts.json"
EARLIER_LAYOUTS = REPO / "bench" / "results" / "cpu-2026-12-01" / "layouts.json"

# the default gate (conf/gate/default.yaml, fp8 thresholds): name -> (metric key, threshold, higher is better)
CHECKS = {"ppl_ratio": ("dnll", math.log(1.10), False), "top1_agreement": ("agree", 0.80, True),
          "kl_mean": ("kl", 0.25, False)}
# the default gate's tail checks: name -> (metric key of the windows it reads, share, bound on the test's scale:
# KL, dNLL = log of the window's ppl ratio, top-1 disagreement)
TAILS = {"kl_tail": ("kl", 0.05, 0.5), "ppl_tail": ("dnll", 0.05, math.log(1.21)), "top1_tail": ("disagree", 0.05, 0.4)}
# healthy levels and spreads per window (fp8-like on the default text: far inside every threshold)
HEALTHY = {"dnll": (0.03, 0.02), "agree": (0.90, 0.03), "kl": (0.03, 0.012)}
# the checked metric at its threshold: window sd as a fraction of the distance to the ideal (real runs: 0.3-0.6)
CV_AT_THRESHOLD = {"dnll": 0.5, "agree": 0.5, "kl": 0.5}


# ------------------------------------------------------------------------------------------------ layouts
def make_layouts(path: Path) -> dict:
    """The documents of the windows of the default pydoc text and of WikiText-2 test in the stored look order (the
    real code path: quantlab.stages.data with the default model's tokenizer)."""
    from quantlab.artifacts import ArtifactStore
    from quantlab.compose import compose
    from quantlab.models import load_tokenizer
    from quantlab.stages import data, prepare

    wiki = REPO.parent.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    if not wiki.is_file():
        wiki = Path("/work/shared/data/wikitext-2-raw/wiki.test.raw")
    out = {}
    for name, over in (("pydoc", []), ("wikitext2", [f"eval.path={wiki}", "eval.doc_separator='^ = [^=].* = $'"])):
        cfg, _ = compose(["+precision=fp8", *over])
        ref = prepare.run(cfg.model, ArtifactStore(Path.home() / ".cache" / "quantlab"))
        tok = load_tokenizer(ref)
        docs = data.Documents("")
        leading = tok("", add_special_tokens=True)["input_ids"]
        _, n_full, _, _, token_docs = data.tokenize_windows(data.source(cfg.eval, data.EVAL), tok, cfg.eval.seq_len,
                                                            None, leading, docs, data._separator(cfg.eval, "eval"))
        window_docs = data.window_documents(token_docs, n_full, cfg.eval.seq_len)
        order = data.look_order(window_docs, cfg.eval.seed)
        out[name] = {"windows": int(n_full), "cap": int(min(n_full, cfg.eval.max_windows)),
                     "docs_in_order": window_docs[order].tolist(), "labels": docs.labels}
    if EARLIER_LAYOUTS.is_file():
        out["pydoc_hash"] = json.loads(EARLIER_LAYOUTS.read_text())["pydoc"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


CAP: dict = {}  # --cap: windows evaluated at most, per layout (default: the default eval.max_windows)


def default_cap() -> int:
    """The default eval.max_windows (quantlab.config.EvalConfig)."""
    from quantlab.config import EvalConfig

    return int(EvalConfig().max_windows)


def layout_pool(name: str, layouts: dict) -> np.ndarray:
    """Document ids of every window of the text's pool, in look order."""
    return np.asarray(layouts[name]["docs_in_order"])


def layout(name: str, layouts: dict) -> np.ndarray:
    """Document ids of the windows up to the cap, in look order (independent: every window its own)."""
    if name == "independent":
        return np.arange(CAP.get(name, default_cap()))
    lay = layouts[name]
    return np.asarray(lay["docs_in_order"][: min(CAP.get(name, default_cap()), lay["windows"])])


# ------------------------------------------------------------------------------------------------ values
def std_skewed(rng, shape, skew: float) -> np.ndarray:
    """Standardized variables with the given skewness (gamma; normal at 0; negative skew mirrored)."""
    if abs(skew) < 1e-9:
        return rng.standard_normal(shape)
    k = 4 / skew ** 2
    x = (rng.gamma(k, 1.0, shape) - k) / math.sqrt(k)
    return x if skew > 0 else -x


def correlated(rng, ids: np.ndarray, sims: int, icc: float, skew: float) -> np.ndarray:
    """[sims, n] standardized window values with intra-document correlation icc and marginal skewness skew."""
    g0 = skew / (icc ** 1.5 + (1 - icc) ** 1.5) if skew else 0.0
    u = std_skewed(rng, (sims, int(ids.max()) + 1), g0)
    e = std_skewed(rng, (sims, ids.size), g0)
    return math.sqrt(icc) * u[:, ids] + math.sqrt(1 - icc) * e


@dataclass
class Row:
    """One simulated setting."""

    layout: str
    icc: float
    skew: float  # of the window values (sign per metric: KL and dNLL right, top-1 left)
    bad_share: float = 0.0
    bad_factor: float = 5.0
    bad_by_document: bool = False
    label: str = ""
    text_relative: bool = False  # the checked metric's mean over the text's whole pool of windows on the threshold
    extra: dict = field(default_factory=dict)


def bad_mask(rng, ids: np.ndarray, sims: int, row: Row) -> np.ndarray:
    """[sims, n] bool: the rare bad windows: each window bad with probability p (scattered), or each document bad
    with probability p, all its windows with it (whole documents); either way the expected share of bad windows is
    p, and a text of few documents often holds no bad document at all."""
    if row.bad_share <= 0:
        return np.zeros((sims, ids.size), dtype=bool)
    if not row.bad_by_document:
        return rng.random((sims, ids.size)) < row.bad_share
    bad_docs = rng.random((sims, int(ids.max()) + 1)) < row.bad_share
    return bad_docs[:, ids]


def metric_values(rng, ids, sims: int, row: Row, key: str, mean_loss: float, sd: float, bad) -> np.ndarray:
    """Per-window values of one metric whose mean loss (bad windows included) is mean_loss (loss: KL, dNLL,
    1 - agreement; rounded to what the gate stores: float32, agreement in steps of 1/512). The sd is the bulk's
    spread at mean_loss, scaled with the bulk (constant coefficient of variation)."""
    sign = -1.0 if key == "agree" else 1.0
    z = correlated(rng, ids, sims, row.icc, sign * row.skew)
    factor = np.where(bad, row.bad_factor, 1.0)
    dilution = 1 - row.bad_share + row.bad_share * row.bad_factor  # mean loss / the bulk's
    loss = (mean_loss / dilution + sign * sd / dilution * z) * factor
    values = 1 - loss if key == "agree" else loss  # KL and dNLL not clipped: a location-scale family
    if key == "agree":  # a share of 512 positions
        values = np.clip(np.round(values * 512) / 512, 0.0, 1.0)
    return values.astype(np.float32).astype(np.float64)


# ------------------------------------------------------------------------------------------------ the gate
def tail_values(values: dict, key: str) -> np.ndarray:
    """The per-window values a tail check reads: in clean rows its own healthy draw ("tail:KEY"), else the run's
    (top-1 disagreement from agreement)."""
    if f"tail:{key}" in values:
        return values[f"tail:{key}"]
    return 1 - values["agree"] if key == "disagree" else values[key]


def gate_vectorized(values: dict, ids: np.ndarray, design, tails=None, checks_=None) -> dict:
    """The gate's decisions on [sims, n] per-window values of every check: for each check its final verdict
    (1 pass, -1 fail, 0 undecided left open because another check failed) and the windows the gate used. The rule
    of quantlab.gate.checks: every check re-decided at every look with stats.interval (documents as clusters) at the
    look's boundary; each tail check with stats.tail_verdicts (the count's exact boundary and Clopper-Pearson lower
    bound, and the latent quantile bound with documents as clusters); stop when every check is decided or one
    failed; undecided at the cap fails."""
    from quantlab.gate import stats

    checks_ = CHECKS if checks_ is None else checks_
    tails = TAILS if tails is None else tails
    sims = next(iter(values.values())).shape[0]
    open_ = np.ones(sims, dtype=bool)
    final = {name: np.zeros(sims, dtype=np.int8) for name in [*checks_, *tails]}
    used = np.full(sims, design.cap)
    for k, n in enumerate(design.looks):
        clusters = stats.Clusters(ids[:n])
        df = None if clusters.singletons else clusters.df
        c = design.t_boundary(k, n, df)
        verdicts = {}
        for name, (key, threshold, hib) in checks_.items():
            _, lo, hi, _ = stats.interval(values[key][:, :n], c, clusters)
            passed, failed = (lo >= threshold, hi < threshold) if hib else (hi <= threshold, lo > threshold)
            verdicts[name] = np.where(passed & design.passable(k), 1, np.where(failed & ~passed, -1, 0))
        for name, (key, share, bound) in tails.items():
            x = tail_values(values, key)[:, :n]
            above = above_of(key, bound)  # the gate's own test on the values it reads
            quantity = (np.exp(x) if key == "dnll" else x)[open_]  # gates still open only: the others are settled
            verdicts[name] = np.zeros(sims, dtype=np.int64)
            verdicts[name][open_] = stats.tail_verdicts(~(quantity <= above), share, design, k,
                                                        stats.tail_latent(quantity, above), math.log(above),
                                                        clusters)[0]
        decided = np.all([v != 0 for v in verdicts.values()], axis=0)
        any_fail = np.any([v == -1 for v in verdicts.values()], axis=0)
        stop = open_ & (decided | any_fail | (k == len(design.looks) - 1))
        for name, v in verdicts.items():
            final[name][stop] = v[stop]
        used[stop] = n
        open_ &= ~stop
    gate_pass = np.all([v == 1 for v in final.values()], axis=0)
    return {"final": final, "used": used, "gate_pass": gate_pass}


def above_of(key: str, bound: float) -> float:
    """A tail's bound as the gate's config writes it (`above`): the ppl ratio exp(dNLL bound) for ppl_tail."""
    return math.exp(bound) if key == "dnll" else bound


def gate_real(values: dict, ids: np.ndarray, design, sims: int, thresholds: dict | None = None) -> dict:
    """The same decisions through quantlab.gate.checks on real Windows objects (one position per window carrying
    the window's value; agreement as 512 positions), for the first `sims` simulated gates (the default gate's
    thresholds unless given)."""
    from quantlab.gate import checks
    from quantlab.gate.config import Threshold
    from quantlab.gate.metrics import Windows

    thresholds = thresholds or {"top1_agreement": Threshold(min=CHECKS["top1_agreement"][1]),
                                "ppl_ratio": Threshold(max=1.10), "kl_mean": Threshold(max=CHECKS["kl_mean"][1]),
                                **{name: Threshold(max=share, above=above_of(key, bound))
                                   for name, (key, share, bound) in TAILS.items()}}
    out = {name: np.zeros(sims, dtype=np.int8) for name in thresholds}
    used = np.zeros(sims, dtype=np.int64)
    t = 512
    for s in range(sims):
        n_all = ids.size
        agree = values["agree"][s]
        hits = np.round(agree * t).astype(int)
        argmax_ref = np.zeros((n_all, t), dtype=np.int32)
        argmax_cand = np.where(np.arange(t)[None, :] < hits[:, None], 0, 1).astype(np.int32)
        arrays = {"kl": np.repeat(values["kl"][s][:, None], t, 1).astype(np.float32),
                  "nll_ref": np.zeros((n_all, t), dtype=np.float32),
                  "nll_cand": np.repeat(values["dnll"][s][:, None], t, 1).astype(np.float32),
                  "dp_true": np.zeros((n_all, t), dtype=np.float32), "dp_top": np.zeros((n_all, t), dtype=np.float32),
                  "argmax_ref": argmax_ref, "argmax_cand": argmax_cand}
        w_all = Windows(arrays, np.zeros((n_all, t), dtype=np.int32), ids)
        found, look = [], 0
        for look, n in enumerate(design.looks):
            found = checks.evaluate_checks(thresholds, w_all.head(n), None, design, look)
            if checks.settled(found):
                break
        found = checks.finish(found, at_cap=look == len(design.looks) - 1)
        for c in found:
            out[c.metric][s] = {"pass": 1, "fail": -1, "undecided": 0}[c.verdict]
        used[s] = design.looks[look]
    return {"final": out, "used": used}


def verified(values: dict, ids: np.ndarray, design, res: dict, gates: int, what: str) -> dict:
    """The first `gates` simulated gates again through quantlab.gate.checks (gate_real): every check's verdict and
    the windows used must equal the vectorized gate's (exit naming `what` when they do not)."""
    real = gate_real(values, ids, design, gates)
    same = all(np.array_equal(real["final"][k], res["final"][k][:gates]) for k in real["final"]) and \
        np.array_equal(real["used"], res["used"][:gates])
    if not same:
        raise SystemExit(f"vectorized and real gate differ: {what}")
    return {"gates": gates, "identical": True}


# ------------------------------------------------------------------------------------------------ rows
def simulate(rng, row: Row, ids, sims: int, target: str | None, shift: float = 0.0, tail=None, pool=None):
    """Per-window values of every check for one row: `target` at its threshold (+ shift toward the good side), the
    others healthy; tail = (name, share): a scattered share of windows put beyond tail check `name`'s bound (the tail
    checks' own rows). When a mean check is the target of a row without bad windows, each tail check reads an
    independent healthy draw of its quantity ("tail:KEY"): the windows of a mean sitting on its threshold would cross
    the tail bounds (twice the threshold's distance from ideal), and the tail checks are calibrated in their own
    rows. With bad windows the tail checks read the windows themselves (the gate as run).

    pool (text-relative rows): the values are drawn for every window of the text's pool (its look order) and the
    target's loss is rescaled per simulated text so that its mean over the whole pool - the text the gate is asked
    about, bad documents or none - sits at its threshold (+ shift); the gate then reads the first windows."""
    if pool is not None:
        values = simulate(rng, row, pool, sims, target, shift, tail)
        if target is not None:
            key, threshold, _ = CHECKS[target]
            want = (1 - threshold if key == "agree" else threshold) - shift
            loss = 1 - values[key] if key == "agree" else values[key]
            mean = loss.mean(1, keepdims=True)  # want <= 0: an MDE beyond the ideal (the check cannot see it)
            loss = loss * (max(want, 0.0) / np.where(mean > 0, mean, 1.0))
            values[key] = np.clip(np.round((1 - loss) * 512) / 512, 0.0, 1.0) if key == "agree" else loss
        return {k: v[:, : ids.size] for k, v in values.items()}
    bad = bad_mask(rng, ids, sims, row)
    values = {}
    for name, (key, threshold, _) in CHECKS.items():
        level, sd = HEALTHY[key]
        loss_level = 1 - level if key == "agree" else level
        if name == target:
            loss_threshold = 1 - threshold if key == "agree" else threshold
            loss_level = loss_threshold - shift
            sd = CV_AT_THRESHOLD[key] * loss_threshold
        values[key] = metric_values(rng, ids, sims, row, key, loss_level, sd, bad)
    if target is not None and row.bad_share == 0:  # clean rows: the tail checks read healthy values of their own
        for key in ("kl", "dnll", "agree"):
            level, sd = HEALTHY[key]
            draw = metric_values(rng, ids, sims, row, key, 1 - level if key == "agree" else level, sd, bad)
            values["tail:disagree" if key == "agree" else f"tail:{key}"] = 1 - draw if key == "agree" else draw
    if tail is not None:  # a tail check's rows: its quantity beyond its bound at exactly this share of windows
        key, _, bound = TAILS[tail[0]]
        beyond = rng.random((sims, ids.size)) < tail[1]
        if key == "disagree":  # disagreement 1.5 B beyond, at most 0.8 B elsewhere (agreement in steps of 1/512)
            dis = np.where(beyond, bound * 1.5, np.minimum(1 - values["agree"], bound * 0.8))
            values["agree"] = np.round((1 - dis) * 512) / 512
        else:
            values[key] = np.where(beyond, bound * 1.5, np.minimum(values[key], bound * 0.8))
    return values


def mde_at_cap(rng, row: Row, ids, design, target: str, sims: int = 2000, pool=None, quantiles=None):
    """The MDE the gate reports for `target` at the cap on data at the threshold (mean over simulated gates; with
    quantiles, those quantiles of it over the simulated runs)."""
    from quantlab.gate import stats

    key, threshold, hib = CHECKS[target]
    values = simulate(rng, row, ids, sims, target, pool=pool)[key]
    clusters = stats.Clusters(ids)
    df = None if clusters.singletons else clusters.df
    k = len(design.looks) - 1
    c = design.t_boundary(k, design.cap, df)
    mean, lo, hi, se = stats.interval(values, c, clusters)
    mde = stats.reported_mde(stats.mde(mean, lo, hi, se, hib, c, design.t_beta(design.cap, c, df)),
                             df or design.cap - 1)[0]
    return float(np.mean(mde)) if quantiles is None else [float(np.quantile(mde, q)) for q in quantiles]


def gate_design(cap: int, alpha: float, beta: float):
    """The default gate's design at this cap: looks of 8, Pocock, first passing look where the tail check can pass
    (quantlab.gate.checks.with_tails)."""
    from quantlab.gate import checks, stats
    from quantlab.gate.config import Threshold

    design = stats.make_design(cap, 8, alpha, beta, True, "pocock")
    return checks.with_tails(design, {name: Threshold(max=share, above=above_of(key, bound))
                                      for name, (key, share, bound) in TAILS.items()})


def wilson(p: float, n: int) -> tuple[float, float]:
    """95% Wilson interval of a share."""
    from quantlab.gate.stats import wilson_interval

    return wilson_interval(p * n, n)


def run_row(rng, row: Row, layouts, sims: int, verify: int, alpha: float, beta: float) -> list[dict]:
    """Type-I and power of every check for one row (and the gate's verdict), with 95% Wilson intervals."""
    from quantlab.gate import stats

    ids = layout(row.layout, layouts)
    pool = layout_pool(row.layout, layouts) if row.text_relative else None
    design = gate_design(ids.size, alpha, beta)
    out = []
    cases = [(name, "type_I") for name in CHECKS] + [(name, "power") for name in CHECKS] + \
        [(name, what) for name in TAILS for what in ("type_I", "power")]
    for name, what in cases:
        if name in TAILS:
            target = TAILS[name][1]
            share = target if what == "type_I" else target - stats.decide_tail(
                np.zeros(design.cap), target, design, len(design.looks) - 1).mde
            values = simulate(rng, row, ids, sims, None, tail=(name, share), pool=pool)
            mde = target - share
        else:
            mde = mde_at_cap(rng, row, ids, design, name, pool=pool) if what == "power" else 0.0
            values = simulate(rng, row, ids, sims, name, shift=mde, pool=pool)
        res = gate_vectorized(values, ids, design)
        p = float((res["final"][name] == 1).mean())
        lo, hi = wilson(p, sims)
        entry = {"row": row.label, "layout": row.layout, "icc": row.icc, "skew": row.skew, "bad_share": row.bad_share,
                 "bad_by_document": row.bad_by_document, "text_relative": row.text_relative, "check": name,
                 "what": what, "sims": sims,
                 "pass_rate": p, "ci95": [lo, hi], "mde": mde, "mean_windows": float(res["used"].mean()),
                 "gate_pass_rate": float(res["gate_pass"].mean())}
        if verify and not any(k.startswith("tail:") for k in values):  # the real gate's tails read the windows
            entry["verified"] = verified(values, ids, design, res, verify, f"{row.label} {name} {what}")
        out.append(entry)
    return out


def rare_bad_rows(rng, layouts, sims: int, alpha: float, beta: float, verify: int = 0) -> list[dict]:
    """Candidates fine on average (every mean at half its distance to the threshold... KL bulk at `level` x the
    kl_mean threshold) with a share of windows `factor` times worse: the share of gates that FAIL."""
    out = []
    for lay in ("pydoc", "wikitext2"):
        ids = layout(lay, layouts)
        design = gate_design(ids.size, alpha, beta)
        for share, factor, by_doc, level in ((0.05, 5, False, 0.5), (0.05, 5, True, 0.5), (0.03, 5, False, 0.5),
                                             (0.02, 5, False, 0.5), (0.05, 5, False, 0.3), (0.05, 20, False, 0.1),
                                             (0.02, 20, False, 0.1)):
            row = Row(lay, 0.1, 1.0, share, factor, by_doc)
            bad = bad_mask(rng, ids, sims, row)
            values = {}
            for key, threshold, _ in CHECKS.values():
                h, sd = HEALTHY[key]
                loss = 1 - h if key == "agree" else h
                if key == "kl":
                    loss, sd = level * threshold * (1 - share + share * factor), 0.4 * level * threshold
                values[key] = metric_values(rng, ids, sims, row, key, loss, sd, bad)
            res = gate_vectorized(values, ids, design)
            fail = float((~res["gate_pass"]).mean())
            lo, hi = wilson(fail, sims)
            out.append({"layout": lay, "bad_share": share, "bad_factor": factor, "bad_by_document": by_doc,
                        "kl_bulk_over_threshold": level, "sims": sims, "gate_fail_rate": fail, "ci95": [lo, hi],
                        "mean_windows": float(res["used"].mean()),
                        "kl_tail_fail": float((res["final"]["kl_tail"] != 1).mean()),
                        "tail_fail": float(np.any([res["final"][t] != 1 for t in TAILS], axis=0).mean())})
            if verify:
                out[-1]["verified"] = verified(values, ids, design, res, verify, f"rare bad {lay} {share} {factor}")
    return out


# candidates shaped like real runs (per-window mean and sd; fp8: the default pydoc run's first 8 windows; the others:
# their WikiText-2 means (bench/RESULTS.md) with a window coefficient of variation of 0.3), and their thresholds
PREDICT = {
    "fp8": ({"dnll": (0.0288, 0.0063), "agree": (0.903, 0.013), "kl": (0.0307, 0.0016)}, CHECKS, TAILS),
    "fp8 kv=fp8": ({"dnll": (0.039, 0.009), "agree": (0.873, 0.018), "kl": (0.045, 0.004)}, CHECKS, TAILS),
    "int8_sq (WikiText-2, pydoc calibration)": ({"dnll": (0.300, 0.09), "agree": (0.699, 0.05), "kl": (0.30, 0.09)},
                                                CHECKS, TAILS),
    "int4_awq": ({"dnll": (0.247, 0.074), "agree": (0.715, 0.03), "kl": (0.22, 0.066)},
                 {"ppl_ratio": ("dnll", math.log(1.35), False), "top1_agreement": ("agree", 0.70, True),
                  "kl_mean": ("kl", 0.50, False)},
                 {"kl_tail": ("kl", 0.05, 1.0), "ppl_tail": ("dnll", 0.05, math.log(1.82)),
                  "top1_tail": ("disagree", 0.05, 0.6)}),
}


def predicted_runs(rng, layouts, sims: int, alpha: float, beta: float) -> list[dict]:
    """Verdict and windows used of the default runs, predicted by simulating the gate on candidates shaped like the
    real runs (PREDICT) on the real document layouts, intra-document correlation 0.3, skewness 1."""
    from quantlab.gate import checks, stats
    from quantlab.gate.config import Threshold

    out = []
    for lay in ("pydoc", "wikitext2"):
        ids = layout(lay, layouts)
        for name, (shape, checks_, tails) in PREDICT.items():
            design = checks.with_tails(stats.make_design(ids.size, 8, alpha, beta, True, "pocock"),
                                       {t: Threshold(max=share, above=above_of(key, bound))
                                        for t, (key, share, bound) in tails.items()})
            row = Row(lay, 0.3, 1.0)
            values = {key: metric_values(rng, ids, sims, row, key, 1 - m if key == "agree" else m, sd,
                                         np.zeros((sims, ids.size), dtype=bool)) for key, (m, sd) in shape.items()}
            res = gate_vectorized(values, ids, design, tails, checks_)
            undecided = np.any([v == 0 for v in res["final"].values()], axis=0) & ~np.any(
                [v == -1 for v in res["final"].values()], axis=0)
            out.append({"layout": lay, "run": name, "pass": float(res["gate_pass"].mean()),
                        "undecided_at_cap": float(undecided.mean()),
                        "windows_median": float(np.median(res["used"])), "windows_mean": float(res["used"].mean())})
    return out


def real_shape(paths: list[str], layouts) -> list[dict]:
    """Skewness and intra-document correlation of real runs' per-window values (metrics.json windows; documents from
    the file, or the pydoc layout when the file predates them)."""
    from scipy import stats as st

    from quantlab.gate import stats

    rows = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        w = doc["windows"]
        n = len(w["dnll"])
        ids = np.asarray(w.get("document") or layouts["pydoc"]["docs_in_order"][:n])
        clusters = stats.Clusters(ids)
        for key in ("dnll", "top1_agreement", "kl_mean"):
            v = np.asarray(w[key], dtype=np.float64)
            summary = stats.cluster_summary(v, clusters)
            rows.append({"run": f"{doc['run']['precision']} kv={doc['run'].get('kv_cache')}", "metric": key,
                         "windows": n, "documents": summary["clusters"], "mean": float(v.mean()),
                         "sd": float(v.std(ddof=1)), "skewness": float(st.skew(v, bias=False)),
                         "icc": summary["icc"], "design_effect": summary["design_effect"],
                         "max": float(v.max())})
    return rows


# ------------------------------------------------------------------------------------ issue 42: tails, MDE
TAIL_SIGMAS = (0.3, 1.0)  # latent (log-scale) sd of a tail check's windows: real runs 0.1-0.2; 1.0 with the floor
DOC_SHARES = (0.0, 0.3, 0.5)  # share of the latent variance the documents explain
TAIL_CASES = (("type_I", 0.05), ("good 1%", 0.01), ("good 0.1%", 0.001), ("bad 15%", 0.15))


def latent_tail(rng, ids, sims: int, key: str, bound: float, share: float, sigma: float, doc_share: float):
    """[sims, n] per-window values of a tail check's quantity, as the bench stores it (KL, dNLL, top-1
    disagreement), log-normal on the latent scale with documents explaining doc_share of the latent variance and
    the population share beyond the gate's bound exactly `share`: log value = log B + sigma (Z - z_{1-share})."""
    from quantlab.gate import stats

    z = correlated(rng, ids, sims, doc_share, 0.0)
    latent = math.log(above_of(key, bound)) + sigma * (z - stats.z(1 - share))
    if key == "dnll":
        return latent.astype(np.float32).astype(np.float64)
    x = np.exp(latent)
    if key == "disagree":  # a share of 512 positions
        return np.clip(np.round(x * 512) / 512, 0.0, 1.0)
    return x.astype(np.float32).astype(np.float64)


def tail_values_for(rng, ids, sims: int, name: str, share: float, sigma: float, doc_share: float) -> dict:
    """Every check's values for one latent tail row: the means healthy, the other tails an independent healthy draw,
    `name` latent at `share`."""
    row = Row("", doc_share, 1.0)
    values = simulate(rng, row, ids, sims, None)
    for key in ("kl", "dnll", "agree"):
        level, sd = HEALTHY[key]
        draw = metric_values(rng, ids, sims, row, key, 1 - level if key == "agree" else level, sd,
                             np.zeros((sims, ids.size), dtype=bool))
        values["tail:disagree" if key == "agree" else f"tail:{key}"] = 1 - draw if key == "agree" else draw
    key, _, bound = TAILS[name]
    values[f"tail:{key}"] = latent_tail(rng, ids, sims, key, bound, share, sigma, doc_share)
    return values


def verified_tail(rng, ids, design, name: str, share: float, sigma: float, doc_share: float, gates: int) -> dict:
    """The tail check alone through quantlab.gate.checks.evaluate_checks / settled / finish on real Windows objects
    (its quantity carried by the windows) against the vectorized gate with only that check: same verdicts and
    windows, gate for gate."""
    key, tshare, bound = TAILS[name]
    x = latent_tail(rng, ids, gates, key, bound, share, sigma, doc_share)
    values = {"kl": np.full((gates, ids.size), 0.03), "dnll": np.full((gates, ids.size), 0.03),
              "agree": np.full((gates, ids.size), 0.9)}
    values["agree" if key == "disagree" else key] = 1 - x if key == "disagree" else x
    from quantlab.gate.config import Threshold

    res = gate_vectorized(values, ids, design, {name: TAILS[name]}, {})
    real = gate_real(values, ids, design, gates, {name: Threshold(max=tshare, above=above_of(key, bound))})
    if not (np.array_equal(real["final"][name], res["final"][name]) and np.array_equal(real["used"], res["used"])):
        raise SystemExit(f"vectorized and real gate differ: latent tail {name} {share} {sigma} {doc_share}")
    return {"gates": gates, "identical": True}


def latent_tail_rows(rng, layouts, names: list[str], args) -> list[dict]:
    """Issue 42 item 1: each tail check with its windows log-normal on the latent scale, documents explaining 0, 30
    or 50% of the latent variance, the population share beyond the bound at the threshold (type-I), well inside it
    (1% and 0.1%: power), at the MDE the gate states at the cap, and clearly bad (15%: the share of gates in which
    the check does not pass). The whole default gate runs (means healthy). From args: sims, alpha, beta, verify,
    tail_sigmas (the latent sds) and tail_cases (only these cases; all when empty)."""
    sims, verify = args.sims, args.verify
    sigmas = tuple(float(x) for x in args.tail_sigmas.split(","))
    cases = tuple(args.tail_cases.split(",")) if args.tail_cases else None
    from quantlab.gate import stats

    out = []
    for lay in names:
        ids = layout(lay, layouts)
        design = gate_design(ids.size, args.alpha, args.beta)
        for doc_share in (DOC_SHARES if lay != "independent" else (0.0,)):
            for sigma in sigmas:
                for name in TAILS:
                    target = TAILS[name][1]
                    last = len(design.looks) - 1
                    stated = stats.decide_tail(np.zeros(ids.size), target, design, last, np.zeros(ids.size),
                                               1.0, stats.Clusters(ids)).mde
                    for what, share in (*TAIL_CASES, ("at stated MDE", target - stated)):
                        if cases is not None and what not in cases:
                            continue
                        values = tail_values_for(rng, ids, sims, name, share, sigma, doc_share)
                        res = gate_vectorized(values, ids, design)
                        p = float((res["final"][name] == 1).mean())
                        lo, hi = wilson(p, sims)
                        entry = {"layout": lay, "doc_share": doc_share, "sigma": sigma, "check": name, "what": what,
                                 "share": share, "sims": sims, "pass_rate": p, "ci95": [lo, hi],
                                 "not_pass_rate": 1 - p, "mean_windows": float(res["used"].mean())}
                        if verify and what == "type_I":
                            entry["verified"] = verified_tail(rng, ids, design, name, share, sigma, doc_share,
                                                              verify)
                        out.append(entry)
                        print(f"tail {lay:10s} docs {doc_share:.0%} sigma {sigma:.1f} {name:9s} {what:13s} share "
                              f"{share:.4g}: pass {p:.4f} [{lo:.4f}, {hi:.4f}] windows {entry['mean_windows']:.1f}"
                              + (" verified" if entry.get("verified") else ""), flush=True)
    return out


def old_mde(rng, row: Row, ids, design, target: str, sims: int) -> np.ndarray:
    """The MDE as reported before issue 42 (point estimate / c4(df) x 1.12), for the comparison."""
    from quantlab.gate import stats

    key, _, hib = CHECKS[target]
    values = simulate(rng, row, ids, sims, target)[key]
    clusters = stats.Clusters(ids)
    df = None if clusters.singletons else clusters.df
    c = design.t_boundary(len(design.looks) - 1, design.cap, df)
    mean, lo, hi, se = stats.interval(values, c, clusters)
    return stats.mde(mean, lo, hi, se, hib, c, design.t_beta(design.cap, c, df)) / stats._c4(df or design.cap - 1) \
        * 1.12


def mde_rows(rng, layouts, names: list[str], sims: int, alpha: float, beta: float) -> list[dict]:
    """Issue 42 item 2: the MDE a run states, over simulated runs of one population at the threshold (its 10th
    percentile, median and 90th percentile), and the gate's power at the median and the 10th-percentile run's
    stated MDE (4000 gates each); the same for the MDE as stated before (point estimate) for comparison."""
    out = []
    for lay in names:
        ids = layout(lay, layouts)
        design = gate_design(ids.size, alpha, beta)
        for icc in ((0.0, 0.3, 0.5) if lay != "independent" else (0.0,)):
            for skew in (1.0, 2.5):
                row = Row(lay, icc, skew)
                for name in CHECKS:
                    new = mde_at_cap(rng, row, ids, design, name, sims, quantiles=(0.1, 0.5, 0.9))
                    old = old_mde(rng, row, ids, design, name, sims)
                    old_q = [float(np.quantile(old, q)) for q in (0.1, 0.5, 0.9)]
                    entry = {"layout": lay, "icc": icc, "skew": skew, "check": name, "sims": sims,
                             "mde_p10_p50_p90": new, "old_mde_p10_p50_p90": old_q, "power": {}}
                    for label, m in (("p10", new[0]), ("median", new[1]), ("old median", old_q[1]),
                                     ("old p10", old_q[0])):
                        res = gate_vectorized(simulate(rng, row, ids, sims, name, shift=m), ids, design)
                        p = float((res["final"][name] == 1).mean())
                        entry["power"][label] = [p, *wilson(p, sims)]
                    out.append(entry)
                    pw = entry["power"]
                    print(f"mde {lay:10s} icc {icc} skew {skew} {name:15s} MDE p10/p50/p90 "
                          f"{new[0]:.4g}/{new[1]:.4g}/{new[2]:.4g} (was {old_q[0]:.4g}/{old_q[1]:.4g}/{old_q[2]:.4g}"
                          f"): power at p10 {pw['p10'][0]:.3f} [{pw['p10'][1]:.3f}], median {pw['median'][0]:.3f} "
                          f"[{pw['median'][1]:.3f}]; old median {pw['old median'][0]:.3f}, old p10 "
                          f"{pw['old p10'][0]:.3f}", flush=True)
    return out


def table_rows(kind: str, layouts: list[str]) -> list[Row]:
    """The rows of the type-I / power table: every layout x ICC x skewness, and rare bad windows."""
    if kind == "rare":
        return []
    if kind == "bad":  # only the rows with rare bad windows (scattered and whole documents)
        return [r for r in table_rows("all", layouts) if r.bad_share]
    if kind == "text":  # only the text-relative whole-document rows
        return [r for r in table_rows("all", layouts) if r.text_relative]
    if kind == "quick":
        return [Row("pydoc", 0.3, 2.5, label="pydoc icc 0.3 skew 2.5"), Row("wikitext2", 0.1, 1.0, label="wiki")]
    rows = []
    for lay in layouts:
        for icc in ((0.0,) if lay == "independent" else (0.0, 0.1, 0.3, 0.5)):
            for skew in (1.0, 2.5):
                rows.append(Row(lay, icc, skew, label=f"{lay} icc {icc} skew {skew}"))
        for share in (0.02, 0.05):
            for by_doc in ((False,) if lay == "independent" else (False, True)):
                rows.append(Row(lay, 0.1, 1.0, share, 5.0, by_doc,
                                label=f"{lay} icc 0.1 skew 1, {share:.0%} of windows 5x worse"
                                      f"{' (whole documents)' if by_doc else ''}"))
            if lay != "independent":  # the same, the text's own mean on the threshold (what the gate is asked)
                rows.append(Row(lay, 0.1, 1.0, share, 5.0, True, text_relative=True,
                                label=f"{lay} icc 0.1 skew 1, {share:.0%} of windows 5x worse (whole documents, "
                                      "the text's mean)"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sims", type=int, default=4000)
    ap.add_argument("--rows", default="all", help="all | quick (two rows) | bad (the rows with rare bad windows) | "
                    "text (whole bad documents, the text's own mean on the threshold) | rare (the rare-bad candidates "
                    "and the predicted default runs) | table (the check rows only) | tails (issue 42: "
                    "tail checks with log-normal windows and document effects) | mde (issue 42: the MDE a run states "
                    "and the power at its median and 10th percentile)")
    ap.add_argument("--verify", type=int, default=0, help="real-gate check of the first N gates of every row")
    ap.add_argument("--tail-sigmas", default=",".join(str(x) for x in TAIL_SIGMAS),
                    help="--rows tails: the latent standard deviations of the rows")
    ap.add_argument("--tail-cases", default="", help="--rows tails: only these cases (comma-separated: type_I, "
                    "good 1%%, good 0.1%%, bad 15%%, at stated MDE)")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--beta", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", default="pydoc,wikitext2,independent", help="the layouts whose rows to run")
    ap.add_argument("--runs", nargs="*", default=[], help="metrics.json files of real runs (skewness, ICC)")
    ap.add_argument("--out", help="write every row as JSON here")
    ap.add_argument("--cap", type=int, help="windows evaluated at most on WikiText-2 and independent windows (the "
                    "default text has 70): the window count a rare share of bad windows needs (issue 24)")
    args = ap.parse_args()
    if args.cap:
        CAP.update(wikitext2=args.cap, independent=args.cap)
    rng = np.random.default_rng(args.seed)
    layouts = json.loads(LAYOUTS.read_text()) if LAYOUTS.is_file() else make_layouts(LAYOUTS)
    start = time.time()
    result = {"real": real_shape(args.runs, layouts) if args.runs else []}
    for r in result["real"]:
        print(f"real {r['run']:22s} {r['metric']:15s} n {r['windows']} docs {r['documents']} skew "
              f"{r['skewness']:+.2f} icc {r['icc'] if r['icc'] is None else round(r['icc'], 3)} "
              f"deff {r['design_effect']:.2f} mean {r['mean']:.4g} sd {r['sd']:.3g} max {r['max']:.4g}", flush=True)
    if args.rows in ("tails", "mde"):  # issue 42: latent tails under document effects; the MDE a run states
        names = [x for x in args.layouts.split(",")]
        result[args.rows] = (latent_tail_rows(rng, layouts, names, args)
                             if args.rows == "tails" else mde_rows(rng, layouts, names, args.sims, args.alpha,
                                                                   args.beta))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"{args.rows}: {len(result[args.rows])} rows x {args.sims} simulated gates, {time.time() - start:.0f} s")
        return
    rows = table_rows(args.rows, args.layouts.split(","))
    result["rows"] = []

    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    for row in rows:
        for entry in run_row(rng, row, layouts, args.sims, args.verify, args.alpha, args.beta):
            result["rows"].append(entry)
            print(f"{entry['row']:58s} {entry['check']:15s} {entry['what']:6s} pass {entry['pass_rate']:.4f} "
                  f"[{entry['ci95'][0]:.4f}, {entry['ci95'][1]:.4f}] MDE {entry['mde']:.4g} windows "
                  f"{entry['mean_windows']:.1f}" + (" verified" if entry.get("verified") else ""), flush=True)
        save()
    if args.rows in ("all", "rare"):
        result["predicted_runs"] = predicted_runs(rng, layouts, args.sims, args.alpha, args.beta)
    for r in result.get("predicted_runs", []):
        print(f"predicted {r['layout']:9s} {r['run']:40s} PASS {r['pass']:.3f} undecided at cap "
              f"{r['undecided_at_cap']:.3f} windows median {r['windows_median']:.0f} mean {r['windows_mean']:.1f}",
              flush=True)
    result["rare_bad"] = rare_bad_rows(rng, layouts, args.sims, args.alpha, args.beta, args.verify) \
        if args.rows in ("all", "rare") else []
    for r in result["rare_bad"]:
        print(f"rare bad {r['layout']:9s} {r['bad_share']:.0%} x{r['bad_factor']} "
              f"{'documents' if r['bad_by_document'] else 'scattered'} KL bulk {r['kl_bulk_over_threshold']}T: "
              f"gate FAIL {r['gate_fail_rate']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] windows "
              f"{r['mean_windows']:.1f}", flush=True)
    print(f"{len(result['rows'])} rows x {args.sims} simulated gates, {time.time() - start:.0f} s")
    save()


if __name__ == "__main__":
    main()
