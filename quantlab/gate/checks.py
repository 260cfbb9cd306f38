"""gate: every threshold is a statistical test, decided from a paired interval over windows -> verdict + reasons.

A check passes when its whole interval (at the sequential design's boundary for the look it was decided at) is on
the good side of the threshold, fails when it is wholly on the bad side, and is otherwise undecided; evaluation
takes another look until every check is decided, and a check still undecided at the cap fails with that reason.
Each check reports its value, interval, threshold, margin and the minimum detectable effect at the windows it
used (quantlab.gate.stats). Directions and ranges come from the metric registry, never from branches on names.

Quantile thresholds (kl_p99 <= t) are tested as the share of positions above t (<= 1%), a mean over windows like
every other check. Means are tested with the windows' documents as clusters (quantlab.gate.stats.Clusters); each
check reports the documents, the measured intra-document correlation and the design effect. A tail check
(kl_tail / ppl_tail / top1_tail: {max: s, above: B}) tests the share of windows whose mean KL / perplexity ratio /
top-1 disagreement exceeds B with exact binomial boundaries and names the windows beyond B. A baseline (metrics.json
of an earlier release) adds paired one-sided regression checks.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from quantlab.errors import QuantlabError
from quantlab.gate import metrics, stats
from quantlab.gate.config import GateConfig, Threshold
from quantlab.gate.metrics import METRICS_SCHEMA, Windows
from quantlab.precisions import PRECISIONS
from quantlab.registry import did_you_mean

UNDECIDED_AT_CAP = "undecided at the cap: raise eval.max_windows or provide more eval text"
NOT_NEEDED = "not decided: the gate had already failed on another check"
MAX_WHERE = 12  # windows a tail check names
MDE_INFLATION_WARNING = 1.5  # few documents: warn when intervals are this much wider than independent windows'


@dataclass
class Check:
    """One gate check as reported (metrics.json, junit.xml, reports)."""

    name: str
    kind: str  # threshold | baseline
    metric: str
    value: float
    threshold: float
    op: str  # ">=" or "<="
    passed: bool
    margin: float  # how far inside (+) or outside (-) the threshold the value is, in the metric's units
    verdict: str = "pass"  # pass | fail | undecided (undecided is a failure at the cap)
    ci: list = field(default_factory=list)  # interval at the decision's level, metric units
    level: float | None = None  # two-sided confidence of that interval
    mde: float | None = None  # minimum detectable effect at the windows used (see mde_unit)
    mde_unit: str = ""
    n: int = 0  # windows (prompts for generation metrics) the decision used
    bucket: str | None = None
    detail: str = ""
    clusters: int | None = None  # documents among the windows used (the interval's clusters)
    icc: float | None = None  # measured intra-document correlation of the tested per-window values
    design_effect: float | None = None  # cluster-robust variance / the variance independent windows would give
    df: float | None = None  # degrees of freedom of the interval (Bell-McCaffrey)
    where: list = field(default_factory=list)  # tail checks: the windows beyond the bound (index, document, value)


# ----------------------------------------------------------------------------------------- validation
def decided_intervals(checks) -> dict[str, list]:
    """metric -> the interval its threshold check over the whole run (not a bucket, not a baseline) decided with,
    read from metrics.json's gate checks; entries that are not well formed (a hand-edited file) are skipped."""
    out = {}
    for c in checks if isinstance(checks, list) else []:
        if (isinstance(c, dict) and c.get("kind", "threshold") == "threshold" and c.get("bucket") is None
                and isinstance(c.get("metric"), str) and isinstance(c.get("ci"), list) and c["ci"]):
            out.setdefault(c["metric"], c["ci"])
    return out


def _check_threshold(where: str, name: str, th: Threshold, seq_len: int | None) -> None:
    """A threshold must be able to fail a worse candidate: finite, inside the metric's range, min <= max, and on
    the side the metric's direction says (a min on a lower-is-better metric passes everything worse)."""
    spec = metrics.METRICS[name]
    for bound in ("min", "max"):
        value = getattr(th, bound)
        if value is None:
            continue
        if not math.isfinite(value):
            raise QuantlabError(f"{where}.{name}.{bound}={value} is not a finite number", fix="give a finite threshold")
        lo, hi = spec.range
        if spec.log_scale and value <= 0:
            raise QuantlabError(f"{where}.{name}.{bound}={value:g}: {name} is a ratio of perplexities, always > 0",
                                fix="give a positive threshold, e.g. max: 1.10")
        if not lo <= value <= hi:
            raise QuantlabError(f"{where}.{name}.{bound}={value:g} is outside {name}'s range [{lo:g}, {hi:g}]",
                                fix=f"a threshold there can never pass or never fail; pick a value in [{lo:g}, {hi:g}]")
    _check_tail(where, name, th, spec)
    if th.min is None and th.max is None:
        raise QuantlabError(f"{where}.{name} has neither min nor max", fix=f"set {where}.{name}.min or .max")
    if th.min is not None and th.max is not None and th.min > th.max:
        raise QuantlabError(f"{where}.{name}: min {th.min:g} > max {th.max:g}, so no value can pass",
                            fix="swap or correct the bounds")
    wrong = "min" if not spec.higher_is_better and th.min is not None else \
        "max" if spec.higher_is_better and th.max is not None else None
    if wrong:
        right = "max" if wrong == "min" else "min"
        direction = "higher" if spec.higher_is_better else "lower"
        raise QuantlabError(f"{where}.{name}.{wrong} bounds {name} from the wrong side: {direction} is better, so a "
                            f"{wrong} threshold passes every worse candidate", fix=f"use {where}.{name}.{right}")
    if th.bucket is not None:
        if name.startswith("gen_"):
            raise QuantlabError(f"{where}.{name}.bucket: generation metrics have no positions to bucket",
                                fix=f"drop {where}.{name}.bucket")
        labels = [b[0] for b in metrics.bucket_bounds(seq_len - 1)] if seq_len else None
        if th.bucket != "worst" and labels is not None and th.bucket not in labels:
            raise QuantlabError(f"{where}.{name}.bucket={th.bucket!r}: eval.seq_len={seq_len} reaches only the buckets "
                                f"{', '.join(labels)}{did_you_mean(th.bucket, labels)}",
                                fix=f"use bucket: worst or one of {', '.join(labels)} (or raise eval.seq_len)")


def _check_tail(where: str, name: str, th: Threshold, spec) -> None:
    """A tail check needs the share (max, strictly between 0 and 1) and the per-window bound (`above`, strictly inside
    the tail's range: a KL > 0, a ppl ratio > 1, a top-1 disagreement in (0, 1)); `above` means nothing elsewhere."""
    if spec.tail_of is None:
        if th.above is not None:
            tails = ", ".join(n for n, s in metrics.METRICS.items() if s.tail_of)
            raise QuantlabError(f"{where}.{name}.above: only tail checks ({tails}) have a per-window bound",
                                fix=f"drop {where}.{name}.above")
        return
    lo, hi = spec.tail_range
    if th.above is None or not math.isfinite(th.above) or not lo < th.above < hi:
        got = "is not set" if th.above is None else f"= {th.above:g} is outside ({lo:g}, {hi:g})"
        raise QuantlabError(f"{where}.{name} needs above, the per-window {spec.tail_words} beyond which a window "
                            f"counts as bad, strictly between {lo:g} and {hi:g}: {where}.{name}.above {got}",
                            fix=f"set {where}.{name}.above, e.g. {spec.tail_example:g}")
    if th.max is None or not 0 < th.max < 1 or th.min is not None or th.bucket is not None:
        raise QuantlabError(f"{where}.{name} bounds the share of windows beyond {th.above:g}: it takes max (strictly "
                            "between 0 and 1) and above, no min or bucket", fix=f"set {where}.{name}.max, e.g. 0.05")


def _as_threshold(where: str, raw) -> Threshold:
    if isinstance(raw, Threshold):
        return raw
    fields = [f for f in Threshold.__dataclass_fields__]
    if not isinstance(raw, dict):
        raise QuantlabError(f"{where} must be a mapping of {', '.join(fields)}, not {raw!r}",
                            fix=f"write {where}.max=VALUE (or min / bucket)")
    for key in raw:
        if key not in fields:
            raise QuantlabError(f"{where} has no {key!r}{did_you_mean(key, fields)}",
                                fix=f"valid keys there: {', '.join(fields)}")
    for key in ("min", "max", "above"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise QuantlabError(f"{where}.{key}={value!r} is not a number", fix=f"give {where}.{key} a number")
    bucket = raw.get("bucket")
    if bucket is not None and not isinstance(bucket, str):
        raise QuantlabError(f"{where}.bucket={bucket!r} is not a bucket name", fix="use bucket: worst or e.g. 512-2k")
    return Threshold(**{k: (float(v) if k in ("min", "max", "above") and v is not None else v)
                        for k, v in raw.items()})


def thresholds_for(cfg: GateConfig, precision: str, seq_len: int | None = None) -> dict[str, Threshold]:
    """The thresholds that apply to a precision (per-precision entries override the common ones), validated."""
    for name in cfg.per_precision:
        if name not in PRECISIONS:
            raise QuantlabError(f"gate.per_precision has unknown precision {name!r}{did_you_mean(name, PRECISIONS)}",
                                fix=f"use one of {', '.join(PRECISIONS)}")
    checked = {}
    for where, table in [("gate.thresholds", cfg.thresholds)] + [
            (f"gate.per_precision.{p}", t) for p, t in cfg.per_precision.items()]:
        for name, th in table.items():
            if name not in metrics.GATEABLE:
                raise QuantlabError(f"gate threshold on unknown metric {name!r}{did_you_mean(name, metrics.GATEABLE)}",
                                    fix=f"gateable metrics: {', '.join(metrics.GATEABLE)}")
            th = _as_threshold(f"{where}.{name}", th)
            _check_threshold(where, name, th, seq_len)
            checked[(where, name)] = th
    merged = {name: checked[("gate.thresholds", name)] for name in cfg.thresholds}
    merged.update({name: checked[(f"gate.per_precision.{precision}", name)]
                   for name in cfg.per_precision.get(precision, {})})
    return merged


def check_gate(cfg: GateConfig, precision: str, eval_cfg=None) -> None:
    """Every gate parameter in range, before any compute."""
    st = cfg.statistical
    for knob, value in (("gate.statistical.alpha", st.alpha), ("gate.statistical.beta", st.beta),
                        ("gate.baseline_alpha", cfg.baseline_alpha)):
        if not (isinstance(value, (int, float)) and 0 < value < 1):
            raise QuantlabError(f"{knob}={value} must be strictly between 0 and 1",
                                fix=f"set {knob} to a probability such as 0.05")
    if st.spending not in stats.SPENDING:
        raise QuantlabError(f"gate.statistical.spending={st.spending!r} is unknown"
                            f"{did_you_mean(st.spending, stats.SPENDING)}",
                            fix=f"use one of {', '.join(stats.SPENDING)}")
    if st.look_windows < 2:
        raise QuantlabError(f"gate.statistical.look_windows={st.look_windows}: a look needs 2 windows or more to "
                            "estimate a spread", fix="set gate.statistical.look_windows to 2 or more (default 8)")
    if eval_cfg is not None and eval_cfg.max_windows is not None and st.sequential and \
            eval_cfg.max_windows < st.look_windows:
        raise QuantlabError(f"eval.max_windows={eval_cfg.max_windows} is smaller than one look of the sequential gate "
                            f"(gate.statistical.look_windows={st.look_windows})",
                            fix=f"raise eval.max_windows to {st.look_windows} or more, or lower the look size")
    merged = thresholds_for(cfg, precision, eval_cfg.seq_len if eval_cfg is not None else None)
    if eval_cfg is not None and eval_cfg.max_windows is not None:
        check_tails(merged, stats.make_design(eval_cfg.max_windows, st.look_windows, st.alpha, st.beta,
                                              st.sequential, st.spending, st.gamma),
                    f"eval.max_windows={eval_cfg.max_windows}", threshold_sources(cfg, precision),
                    seq_len=eval_cfg.seq_len)
    if not merged and not cfg.baseline:
        raise QuantlabError("the gate has no checks: no thresholds and no baseline, so it could only ever pass",
                            fix="use gate=default or gate=strict, or add gate.thresholds.METRIC.min/max")


def check_tails(thresholds: dict[str, Threshold], design: stats.Design, what: str, sources: dict | None = None,
                available: int | None = None, seq_len: int | None = None) -> None:
    """Tail checks that no count can pass at any look of the design could only fail: exit 2 naming every one of them
    with the windows it needs (about 3 / max with none beyond the bound, more with alpha spent over looks), and the
    exact overrides that drop or relax each (sources: check -> the config paths that set it; available: the windows
    the evaluation text gives, so that raising eval.max_windows is offered only where the text has them)."""
    blocked = []
    for name, th in thresholds.items():
        if metrics.METRICS[name].tail_of is None or th.max is None:
            continue
        if max(stats.tail_boundaries(design.looks, th.max, design.alpha, design.kind, design.gamma)) >= 0:
            continue
        need = next((n for n in range(design.cap, 100_000) if stats.tail_boundaries(
            stats.make_design(n, design.looks[0], design.alpha, design.beta, len(design.looks) > 1, design.kind,
                              design.gamma).looks, th.max, design.alpha, design.kind, design.gamma)[-1] >= 0), None)
        blocked.append((name, th, need))
    if not blocked:
        return
    names = ", ".join(name for name, _, _ in blocked)
    reasons = "; ".join(f"{name}: showing that fewer than {th.max:.0%} of windows are beyond {th.above:g} takes "
                        f"{need} windows with none beyond it" for name, th, need in blocked)
    need = max((n for _, _, n in blocked if n is not None), default=None)
    raise QuantlabError(f"gate {names} can never pass with {design.cap} windows ({what}): {reasons}",
                        fix=_tail_fix(blocked, design, need, sources or {}, available, seq_len))


def _tail_fix(blocked: list, design: stats.Design, need: int | None, sources: dict, available: int | None,
              seq_len: int | None) -> str:
    """The three ways out of a tail check the text cannot pass, each as the exact overrides to type."""
    paths = [p for name, _, _ in blocked for p in sources.get(name, [f"gate.thresholds.{name}"])]
    relax = []
    for name, th, _ in blocked:
        share = next((m / 100 for m in range(int(th.max * 100) + 1, 100) if max(stats.tail_boundaries(
            design.looks, m / 100, design.alpha, design.kind, design.gamma)) >= 0), None)
        if share is not None:
            relax += [f"{p}.max={share:g}" for p in sources.get(name, [f"gate.thresholds.{name}"])]
    ways = [f"drop them: {' '.join('~' + p for p in paths)} (the gate then judges the means only: a candidate "
            "broken on a few percent of the text can pass)"]
    if relax:
        ways.append(f"or relax them to the smallest share {design.cap} windows can show: {' '.join(relax)} (a "
                    "candidate broken on that share of the text passes)")
    if need is not None:
        if available is None:  # known before the text is read: the cap is what blocks
            more = f" of {seq_len} tokens" if seq_len else ""
            ways.append(f"or evaluate more windows: eval.max_windows={need} (the text must give {need} windows{more})")
        elif available >= need:
            ways.append(f"or evaluate more of the text: eval.max_windows={need}")
        else:
            more = f" of {seq_len} tokens" if seq_len else ""
            ways.append(f"or evaluate on a longer text: eval.path=FILE giving at least {need} windows{more} (this "
                        f"one gives {available if available is not None else design.cap})")
    return "; ".join(ways)


def threshold_sources(cfg: GateConfig, precision: str) -> dict[str, list[str]]:
    """Each check that applies to the precision -> the config paths that set it (a per-precision entry overrides the
    common one, so dropping a check takes both)."""
    out: dict[str, list[str]] = {}
    for name in cfg.thresholds:
        out.setdefault(name, []).append(f"gate.thresholds.{name}")
    for name in cfg.per_precision.get(precision, {}):
        out.setdefault(name, []).append(f"gate.per_precision.{precision}.{name}")
    return out


def check_evaluation_text(cfg: GateConfig, precision: str, evalset, max_windows: int | None) -> list[str]:
    """What the evaluation text decides of the gate before any compute (the data stage tokenizes it before
    calibration): a tail check it cannot pass and a single document are exit 2; few documents a warning."""
    thresholds = thresholds_for(cfg, precision, evalset.seq_len)
    design = with_tails(design_for(cfg, evalset.num_windows, max_windows), thresholds)
    full, ended = evalset.info.get("full_windows", evalset.num_windows), evalset.info.get("text_ended", True)
    capped = not ended or full > evalset.num_windows  # the cap kept fewer windows than the text has
    what = (f"eval.max_windows={max_windows} keeps {evalset.num_windows}" if capped
            else f"the evaluation text gives {evalset.num_windows}")
    # read only as far as the cap: the text holds more windows than were tokenized (at least one more)
    available = full if ended else max(full, evalset.num_windows) + 10 ** 9
    check_tails(thresholds, design, what, threshold_sources(cfg, precision), available, evalset.seq_len)
    return check_documents(evalset.docs, design)


def passing_windows(cfg: GateConfig, precision: str, windows: int, cap: int | None, seq_len: int) -> int:
    """The windows a passing run reads: the first look at which every check can pass (the tail checks need many
    windows; without them, the first look), of a text giving `windows` under the cap. A run that passes reads at
    least these and usually stops there; a failing one may stop earlier, an undecided one reads on to the cap."""
    try:
        design = with_tails(design_for(cfg, windows, cap), thresholds_for(cfg, precision, seq_len))
    except QuantlabError:
        return min(windows, cap or windows)
    return design.looks[design.first_pass]


def with_tails(design: stats.Design, thresholds: dict[str, Threshold]) -> stats.Design:
    """The design with first_pass at the first look where every tail check can pass: before it the gate cannot
    pass, so the mean checks spend their alpha over the looks from there on (they can still fail earlier)."""
    first = 0
    for name, th in thresholds.items():
        if metrics.METRICS[name].tail_of is not None and th.max is not None:
            bounds = stats.tail_boundaries(design.looks, th.max, design.alpha, design.kind, design.gamma)
            first = max(first, next((k for k, c in enumerate(bounds) if c >= 0), len(design.looks) - 1))
    return dataclasses.replace(design, first_pass=first)


def design_for(cfg: GateConfig, windows_available: int, cap: int | None) -> stats.Design:
    """Looks every gate.statistical.look_windows windows up to the cap (eval.max_windows, or all the text has)."""
    st = cfg.statistical
    n = min(windows_available, cap or windows_available)
    if n < 2:
        raise QuantlabError(f"the evaluation text gives {n} window(s); a paired interval needs 2 or more",
                            fix="give more evaluation text or lower eval.seq_len")
    return stats.make_design(n, st.look_windows, st.alpha, st.beta, st.sequential, st.spending, st.gamma)


# ----------------------------------------------------------------------------------------------- tests
@dataclass
class _Test:
    values: np.ndarray  # per window (per prompt for generation), in the test's scale
    threshold: float  # in the test's scale
    higher_is_better: bool
    to_metric: object = None  # monotone map from the test's scale to the metric's (exp for ratios of NLL)
    binary: bool = False
    value: float | None = None  # the metric's value when the test is not on its scale (percentiles)
    ci: list | None = None
    mde_unit: str = ""
    tail: np.ndarray | None = None  # tail checks: the per-window values compared with the bound


def _test(name: str, bound: float, w: Windows, gen: dict | None, above: float | None = None) -> _Test:
    spec = metrics.METRICS[name]
    hib = spec.higher_is_better
    if spec.tail_of is not None:  # share of windows beyond `above` < bound, tested on 0/1 outcomes
        values = spec.tail_value(w.per_window(spec.tail_of))  # a window that is not a number is beyond any bound
        return _Test((~(values <= above)).astype(np.float64), bound, False, binary=True, tail=values,
                     mde_unit=f"share of windows with {spec.tail_words} > {above:g}")
    if spec.quantile is not None:  # p-th percentile <= t  <=>  share of positions above t <= 1 - p
        q = spec.quantile
        return _Test(w.exceedance(bound), 1 - q, False, value=stats.percentile(w.a["kl"], q),
                     mde_unit=f"share of positions with KL > {bound:g}")
    if spec.log_scale:
        key = "dnll" if name == "ppl_ratio" else "nll_cand"
        return _Test(w.per_window(key), math.log(bound), hib, math.exp, mde_unit="nats per token")
    if name.startswith("gen_"):
        if not gen or not gen.get("first_divergence"):
            raise QuantlabError(f"the gate needs {name}, which this run does not measure",
                                fix="enable it (eval.gen_prompts > 0 and eval.gen_tokens > 0) or drop the threshold")
        fd = np.asarray(gen["first_divergence"], dtype=np.float64)
        if name == "gen_exact_match":
            return _Test((fd >= gen["new_tokens"]).astype(np.float64), bound, hib, binary=True, mde_unit="share")
        return _Test(fd, bound, hib, mde_unit="tokens")
    key = {"top1_agreement": "agree", "kl_mean": "kl", "dnll_mean": "dnll", "dp_true_mean": "dp_true",
           "flip_rate": "flip_rate", "net_flip_rate": "net_flip", "router_topk_agreement": "router_agree"}[name]
    if key not in ("agree", "kl", "dnll", "dp_true", "flip_rate", "net_flip") and key not in w.a:
        raise QuantlabError(f"the gate needs {name}, which this model does not have (a dense model has no router)",
                            fix=f"drop the {name} threshold for dense models")
    return _Test(w.per_window(key), bound, hib, mde_unit=spec.unit or "")


def _one(name: str, th: Threshold, op: str, w: Windows, gen: dict | None, design: stats.Design, look: int,
         bucket: str | None) -> Check:
    bound = th.min if op == ">=" else th.max
    test = _test(name, bound, w, gen, th.above)
    clusters = w.clusters() if not name.startswith("gen_") else None
    if test.tail is not None:
        d = stats.decide_tail(test.values, test.threshold, design, look, stats.tail_latent(test.tail, th.above),
                              math.log(th.above), clusters)
    elif test.binary:
        d = stats.decide_binary(test.values, test.threshold, test.higher_is_better, design, look)
    else:
        d = stats.decide(test.values, test.threshold, test.higher_is_better, design, look, clusters)
    f = test.to_metric or (lambda x: x)
    if test.value is not None:  # a percentile: report it, its bootstrap interval, the decision from exceedances
        value = test.value
        ci = list(stats.cluster_bootstrap(list(w.a["kl"].astype(np.float64)),
                                          lambda v: float(np.quantile(v, metrics.METRICS[name].quantile))))
    else:
        value, ci = f(d.value), [f(d.lo), f(d.hi)]
    margin = (value - bound) if op == ">=" else (bound - value)
    level = 1 - 2 * stats._phi(-d.boundary) if not test.binary and math.isfinite(d.boundary) else None
    mde, mde_unit = float(d.mde), test.mde_unit
    estimate = d.mde_estimate
    if test.to_metric is not None and math.isfinite(mde):  # tested on a log scale: the MDE in the metric's units
        def in_units(x):
            return abs(bound - f(test.threshold + x if test.higher_is_better else test.threshold - x))
        mde, mde_unit = in_units(d.mde), metrics.METRICS[name].unit or "ratio"
        estimate = in_units(estimate) if estimate is not None else None
    detail = (f"{d.verdict} at {d.n} windows: interval [{ci[0]:.4g}, {ci[1]:.4g}] vs {op} {bound:g}"
              + (f" (tested as {test.mde_unit} <= {test.threshold:g}: {d.value:.4g} [{d.lo:.4g}, {d.hi:.4g}])"
                 if test.value is not None else ""))
    if estimate is not None and math.isfinite(mde):
        detail += (f"; MDE {mde:.3g} is an upper {stats.MDE_CONFIDENCE:.0%} bound from this run's spread "
                   f"({d.df:.1f} degrees of freedom; point estimate {estimate:.3g})")
    if d.quantile_hi is not None:
        q_hi = math.exp(d.quantile_hi) if math.isfinite(d.quantile_hi) else math.inf
        detail += (f"; the windows' {100 * (1 - test.threshold):g}th percentile of {metrics.METRICS[name].tail_words} "
                   f"is at most {q_hi:.3g} (documents as clusters; a pass needs <= {th.above:g})")
    summary = stats.cluster_summary(test.values, clusters) if not name.startswith("gen_") else {}
    where = []
    if test.tail is not None:
        beyond = np.flatnonzero(test.values > 0)
        where = [{"window": w.label(int(i)), "value": float(test.tail[i])}
                 for i in beyond[np.argsort(-test.tail[beyond])][:MAX_WHERE]]
        detail += f"; {int(beyond.size)} of {d.n} windows beyond {th.above:g}" + (
            ": " + ", ".join(f"{x['window']} {x['value']:.3g}" for x in where) if where else "")
    return Check(f"{name} {op} {bound:g}" + (f" [{bucket}]" if bucket else "") +
                 (f" (windows with {metrics.METRICS[name].tail_words} above {th.above:g})" if test.tail is not None
                  else ""), "threshold", name, float(value),
                 float(bound), op, d.verdict == "pass", float(margin), d.verdict, [float(ci[0]), float(ci[1])],
                 level, mde, mde_unit, d.n, bucket, detail, summary.get("clusters"), summary.get("icc"),
                 summary.get("design_effect"), summary.get("df"), where)


def _bucketed(name: str, th: Threshold, op: str, w: Windows, gen, design, look, bucket: str) -> Check:
    bound = th.min if op == ">=" else th.max
    bounds = metrics.bucket_bounds(w.t)
    chosen = bounds if bucket == "worst" else [b for b in bounds if b[0] == bucket]
    checks = [_one(name, th, op, w.columns(lo, hi), gen, design, look, label) for label, lo, hi in chosen]
    worst = min(checks, key=lambda c: c.margin)
    verdicts = {c.verdict for c in checks}
    verdict = "fail" if "fail" in verdicts else "undecided" if "undecided" in verdicts else "pass"
    worst.verdict, worst.passed = verdict, verdict == "pass"
    worst.name = f"{name} {op} {bound:g} [{'worst bucket: ' if bucket == 'worst' else ''}{worst.bucket}]"
    worst.detail += "; per bucket: " + ", ".join(f"{c.bucket} {c.value:.4g} {c.verdict}" for c in checks)
    return worst


def evaluate_checks(thresholds: dict[str, Threshold], w: Windows, gen: dict | None, design: stats.Design,
                    look: int) -> list[Check]:
    """Every threshold check on the windows seen so far, at one look of the design."""
    out = []
    for name, th in thresholds.items():
        for bound, op in ((th.min, ">="), (th.max, "<=")):
            if bound is None:
                continue
            if th.bucket:
                out.append(_bucketed(name, th, op, w, gen, design, look, th.bucket))
            else:
                out.append(_one(name, th, op, w, gen, design, look, None))
    return out


def settled(checks: list[Check]) -> bool:
    """True when the gate's verdict is known (evaluation can stop taking looks): no check is undecided, or one has
    failed (the gate fails whatever the others would say; stopping then can only lower the chance of a PASS)."""
    return all(c.verdict != "undecided" for c in checks) or any(c.verdict == "fail" for c in checks)


def finish(checks: list[Check], at_cap: bool) -> list[Check]:
    """At the cap an undecided check is a failure, with the reason; before it, an undecided check left open because
    another failed says so."""
    for c in checks:
        if c.verdict == "undecided":
            c.passed = False
            c.detail = f"{UNDECIDED_AT_CAP if at_cap else NOT_NEEDED}; {c.detail}"
    return checks


def check_documents(docs, design: stats.Design) -> list[str]:
    """The documents of the windows up to the cap against the error rates asked for: fewer than 2 documents leave no
    between-document variance to estimate (exit 2, with the fix); with few documents the intervals' degrees of freedom
    make every interval wider than independent windows would: a warning when the minimum detectable effect at the
    cap grows by more than MDE_INFLATION_WARNING."""
    if docs is None:
        return []
    clusters = stats.Clusters(np.asarray(docs)[: design.cap])
    if clusters.g < 2:
        raise QuantlabError(f"the {design.cap} evaluation windows all come from one document, so no interval over "
                            "documents exists (a document's windows are not independent)",
                            fix="give text with more documents (records, rows, blank-line separated paragraphs), or "
                                "set eval.doc_separator to the line that starts each of its documents")
    if clusters.singletons:
        return []
    k = len(design.looks) - 1
    c_z, c_t = design.z_boundary(k), design.t_boundary(k, design.cap, clusters.df)
    ratio = (c_t + design.t_beta(design.cap, c_t, clusters.df)) / (c_z + stats.z(1 - design.beta))
    if ratio <= MDE_INFLATION_WARNING:
        return []
    return [f"the {design.cap} evaluation windows come from {clusters.g} documents (interval degrees of freedom "
            f"{clusters.df:.1f}): minimum detectable effects are {ratio:.2f}x those of independent windows. Use "
            "evaluation text with more documents, or raise eval.max_windows / eval.pool_windows"]


def power_warnings(checks: list[Check]) -> list[str]:
    """Undecided checks whose design could not tell even an ideal candidate from one on the threshold at the windows
    used (a check decided either way needs no such warning: the verdict was seen)."""
    out = []
    for c in checks:
        spec = metrics.METRICS[c.metric]
        if spec.ideal is None or c.mde is None or not math.isfinite(c.mde) or spec.quantile is not None:
            continue
        ideal, bound = spec.ideal, c.threshold
        distance = abs(bound - ideal)  # the MDE is in the metric's units (log-scale tests converted in _one)
        if c.mde > distance and c.verdict == "undecided":  # a decided FAIL needed no more power to be seen
            out.append(f"{c.name}: with {c.n} windows the smallest detectable distance from the threshold is "
                       f"{c.mde:.3g} {c.mde_unit}, more than the distance from the ideal value to the threshold "
                       f"({distance:.3g}): even a perfect candidate would often fail. Raise eval.max_windows or use "
                       "more eval text")
    return out


# ---------------------------------------------------------------------------------------------- baseline
def load_baseline(path: str, provenance: dict) -> dict:
    """Read gate.baseline (an earlier run's directory or its metrics.json) for the regression checks. Exit 2 when it
    is missing, not JSON, of another schema, measured on another model or eval data, or without per-window values."""
    p = Path(path).expanduser()
    if p.is_dir():  # a run directory, as a user naturally gives it: its metrics.json
        if not (p / "metrics.json").is_file():
            raise QuantlabError(f"gate.baseline {p} is a directory without a metrics.json (not an evaluated run)",
                                fix="point gate.baseline at the directory of an earlier run that evaluated (or at "
                                    "its metrics.json)")
        p = p / "metrics.json"
    if not p.is_file():
        raise QuantlabError(f"gate.baseline {p} does not exist",
                            fix="point gate.baseline at an earlier run's directory or its metrics.json")
    try:
        base = json.loads(p.read_text())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise QuantlabError(f"gate.baseline {p} is not JSON ({str(exc)[:120]})",
                            fix="point gate.baseline at an earlier run's metrics.json") from None
    if not isinstance(base, dict) or base.get("schema") != METRICS_SCHEMA:
        raise QuantlabError(f"gate.baseline {p} has schema {base.get('schema') if isinstance(base, dict) else None!r}, "
                            f"expected {METRICS_SCHEMA!r}", fix="use a metrics.json written by this quantlab version")
    for what, key in (("model", "model_fingerprint"), ("evaluation data", "eval_fingerprint")):
        theirs, ours = base.get("provenance", {}).get(key), provenance.get(key)
        if theirs != ours:
            raise QuantlabError(f"gate.baseline {p} was measured on different {what} ({key} {theirs} vs {ours}); "
                                "the comparison would be meaningless",
                                fix="rerun the baseline on the same model and eval data, or drop gate.baseline")
    windows = base.get("windows")
    if not (isinstance(windows, dict) and all(isinstance(windows.get(k), list) for k in BASELINE_KEYS.values())):
        raise QuantlabError(f"gate.baseline {p} has no per-window values", fix="use a metrics.json of a full run")
    return base


BASELINE_KEYS = {"top1_agreement": "top1_agreement", "kl_mean": "kl_mean", "dnll_mean": "dnll"}


def baseline_checks(base: dict, windows: dict, measured: dict, alpha: float) -> tuple[list[Check], dict]:
    """Paired per-window comparison on the windows both runs evaluated: fail where the candidate is
    significantly worse than the baseline (one-sided paired t over windows)."""
    checks, table = [], {}
    bw = base["windows"]
    for name, key in BASELINE_KEYS.items():
        n = min(len(windows[key]), len(bw[key]))
        ours, theirs = np.asarray(windows[key][:n], dtype=float), np.asarray(bw[key][:n], dtype=float)
        hib = metrics.METRICS[name].higher_is_better
        worse = (theirs - ours) if hib else (ours - theirs)  # > 0 means the candidate is worse
        mean, lo, hi = stats.t_interval(worse, confidence=1 - 2 * alpha)
        base_value = base["metrics"].get(name, {}).get("value")
        table[name] = {"baseline": base_value, "candidate": measured[name]["value"], "windows": n,
                       "difference": measured[name]["value"] - base_value if base_value is not None else None,
                       "worse_by": mean, "worse_ci": [lo, hi]}
        passed = not lo > 0
        checks.append(Check(f"{name} not significantly worse than baseline", "baseline", name, mean, 0.0, "<=",
                            passed, -lo, "pass" if passed else "fail", [lo, hi], 1 - 2 * alpha, None, "", n, None,
                            f"one-sided paired t over {n} windows, alpha={alpha}"))
    return checks, table


def blind_share(windows: int, alpha: float) -> float:
    """The share of the text's windows a fault can hide in: below it, all of them are absent from `windows` windows
    drawn across the text with probability above alpha, (1 - share) ** windows > alpha. No check sees what no
    evaluated window contains, so a verdict says nothing about such a fault, however its intervals were computed
    (64 windows: 4.6%; 150 windows are needed for 2%)."""
    return 1.0 - alpha ** (1.0 / windows)


def verdict(cfg: GateConfig, thresholds: dict[str, Threshold], checks: list[Check], design: stats.Design, look: int,
            windows: dict, measured: dict, provenance: dict) -> dict:
    """The gate section of metrics.json: the design, every check, the verdict and warnings."""
    warnings = power_warnings(checks)
    section: dict = {"thresholds": {k: asdict(v) for k, v in thresholds.items()},
                     "design": {"alpha": design.alpha, "beta": design.beta, "spending": design.kind,
                                "gamma": design.gamma if design.kind == "hsd" else None, "looks": list(design.looks),
                                "stopped_at_look": look + 1, "windows_used": design.looks[look],
                                "cap": design.cap, "sequential": len(design.looks) > 1,
                                "first_passing_look": design.first_pass + 1,
                                "boundaries_z": [design.z_boundary(k) for k in range(len(design.looks))],
                                "blind_share": blind_share(design.looks[look], design.alpha)}}
    all_checks = list(checks)
    if cfg.baseline:
        base = load_baseline(cfg.baseline, provenance)
        base_checks, section["baseline"] = baseline_checks(base, windows, measured, cfg.baseline_alpha)
        section["baseline"]["path"] = cfg.baseline
        all_checks += base_checks
    section.update(passed=all(c.passed for c in all_checks), checks=[asdict(c) for c in all_checks], warnings=warnings)
    return section
