"""gate: thresholds, a statistical test and an optional baseline regression check -> verdict + reasons.

Every check is evaluated and reported (not only the first failure), each with value, threshold and margin.
Directions come from the metric registry (`higher_is_better`), never from branches on names.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from quantlab import metrics
from quantlab.config import GateConfig, Threshold
from quantlab.errors import QuantlabError
from quantlab.metrics import METRICS_SCHEMA
from quantlab.precisions import PRECISIONS
from quantlab.registry import did_you_mean


@dataclass
class Check:
    name: str
    kind: str  # threshold | statistical | baseline
    metric: str
    value: float
    threshold: float
    op: str  # ">=" or "<="
    passed: bool
    margin: float  # how far inside (+) or outside (-) the threshold, in the metric's units
    detail: str = ""


def _check_threshold(where: str, name: str, th: Threshold) -> None:
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
        if not lo <= value <= hi:
            raise QuantlabError(f"{where}.{name}.{bound}={value:g} is outside {name}'s range [{lo:g}, {hi:g}]",
                                fix=f"a threshold there can never pass or never fail; pick a value in [{lo:g}, {hi:g}]")
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
                            f"{wrong} threshold passes every worse candidate",
                            fix=f"use {where}.{name}.{right}")


def thresholds_for(cfg: GateConfig, precision: str) -> dict[str, Threshold]:
    """The thresholds that apply to a precision (per-precision entries override the common ones), validated."""
    for name in cfg.per_precision:
        if name not in PRECISIONS:
            raise QuantlabError(f"gate.per_precision has unknown precision {name!r}{did_you_mean(name, PRECISIONS)}",
                                fix=f"use one of {', '.join(PRECISIONS)}")
    as_threshold = {}
    for where, table in [("gate.thresholds", cfg.thresholds)] + [
            (f"gate.per_precision.{p}", t) for p, t in cfg.per_precision.items()]:
        for name, th in table.items():
            if name not in metrics.GATEABLE:
                raise QuantlabError(f"gate threshold on unknown metric {name!r}{did_you_mean(name, metrics.GATEABLE)}",
                                    fix=f"gateable metrics: {', '.join(metrics.GATEABLE)}")
            # OmegaConf leaves dataclasses nested two dicts deep as plain dicts
            th = th if isinstance(th, Threshold) else Threshold(**th)
            _check_threshold(where, name, th)
            as_threshold[(where, name)] = th
    merged = {name: as_threshold[("gate.thresholds", name)] for name in cfg.thresholds}
    merged.update({name: as_threshold[(f"gate.per_precision.{precision}", name)]
                   for name in cfg.per_precision.get(precision, {})})
    return merged


def check_gate(cfg: GateConfig, precision: str) -> None:
    """Every gate parameter in range, before any compute."""
    for knob, value in (("gate.statistical.alpha", cfg.statistical.alpha), ("gate.statistical.beta", cfg.statistical.beta),
                        ("gate.baseline_alpha", cfg.baseline_alpha)):
        if not (isinstance(value, (int, float)) and 0 < value < 1):
            raise QuantlabError(f"{knob}={value} must be strictly between 0 and 1",
                                fix=f"set {knob} to a probability such as 0.05")
    thresholds_for(cfg, precision)


def _threshold_checks(merged: dict[str, Threshold], measured: dict) -> list[Check]:
    checks = []
    for name, th in merged.items():
        if name not in measured:
            raise QuantlabError(f"the gate needs {name}, which this run does not measure",
                                fix="enable it (generation metrics need eval.gen_prompts > 0) or drop the threshold")
        value = measured[name]["value"]
        if th.min is not None:
            checks.append(Check(f"{name} >= {th.min:g}", "threshold", name, value, th.min, ">=", value >= th.min, value - th.min))
        if th.max is not None:
            checks.append(Check(f"{name} <= {th.max:g}", "threshold", name, value, th.max, "<=", value <= th.max, th.max - value))
    return checks


def _statistical(cfg: GateConfig, merged: dict[str, Threshold], windows: dict, warnings: list[str]) -> tuple[list[Check], dict]:
    """Mean per-window NLL of the candidate vs the tolerated NLL, TensorRT-LLM accuracy-suite style."""
    ref = np.asarray(windows["nll_reference"])
    cand = np.asarray(windows["nll_candidate"])
    n = ref.size
    if n < 2:
        warnings.append("statistical gate skipped: it needs at least 2 evaluation windows")
        return [], {"skipped": "fewer than 2 windows"}
    st = cfg.statistical
    sigma = float(ref.std(ddof=1))
    ratio = merged.get("ppl_ratio")
    margin = math.log(ratio.max) if ratio is not None and ratio.max is not None else 0.0
    allowed = float(ref.mean()) + margin
    threshold, theta = metrics.statistical_threshold(allowed, sigma, n, st.alpha, st.beta, higher_is_better=False)
    value = float(cand.mean())
    info = {"metric": "mean NLL per window (nats)", "alpha": st.alpha, "beta": st.beta, "sigma": sigma, "n": n,
            "reference": float(ref.mean()), "allowed_margin": margin, "threshold": threshold, "theta": theta,
            "candidate": value}
    if margin > 0 and theta > margin:
        need = metrics.windows_needed(sigma, margin, st.alpha, st.beta)
        info["windows_needed"] = need
        warnings.append(f"n={n} windows is too few to detect a regression as large as the tolerance "
                        f"(theta={theta:.3f} nats > log(max ppl_ratio)={margin:.3f}); about {need} windows would "
                        f"(raise eval.max_windows or use more eval text)")
    check = Check("mean NLL <= statistical threshold", "statistical", "nll_candidate", value, threshold, "<=",
                  value <= threshold, threshold - value,
                  f"ref {info['reference']:.4f} + margin {margin:.4f} + z_alpha*sqrt(2*sigma^2/n); theta {theta:.4f}")
    return [check], info


def load_baseline(path: str, provenance: dict) -> dict:
    p = Path(path).expanduser()
    if not p.is_file():
        raise QuantlabError(f"gate.baseline {p} does not exist", fix="point gate.baseline at an earlier run's metrics.json")
    try:
        base = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantlabError(f"gate.baseline {p} is not JSON ({exc})") from None
    if not isinstance(base, dict) or base.get("schema") != METRICS_SCHEMA:
        raise QuantlabError(f"gate.baseline {p} has schema {base.get('schema') if isinstance(base, dict) else None!r}, "
                            f"expected {METRICS_SCHEMA!r}", fix="use a metrics.json written by this quantlab version")
    for what, key in (("model", "model_fingerprint"), ("evaluation data", "eval_fingerprint")):
        theirs, ours = base.get("provenance", {}).get(key), provenance.get(key)
        if theirs != ours:
            raise QuantlabError(f"gate.baseline {p} was measured on different {what} ({key} {theirs} vs {ours}); "
                                "the comparison would be meaningless",
                                fix="rerun the baseline on the same model and eval data, or drop gate.baseline")
    return base


def _baseline_checks(base: dict, windows: dict, measured: dict, alpha: float) -> tuple[list[Check], dict]:
    """Paired per-window comparison: fail where the candidate is significantly worse than the baseline."""
    pairs = {"top1_agreement": "top1_agreement", "kl_mean": "kl_mean", "dnll_mean": None}
    bw = base["windows"]
    checks, table = [], {}
    for name, key in pairs.items():
        if key is None:
            ours = np.asarray(windows["nll_candidate"]) - np.asarray(windows["nll_reference"])
            theirs = np.asarray(bw["nll_candidate"]) - np.asarray(bw["nll_reference"])
        else:
            ours, theirs = np.asarray(windows[key]), np.asarray(bw[key])
        hib = metrics.METRICS[name].higher_is_better
        worse = (theirs - ours) if hib else (ours - theirs)  # > 0 means the candidate is worse
        mean, lo, _ = metrics.t_interval(worse, confidence=1 - 2 * alpha)
        base_value = base["metrics"].get(name, {}).get("value")
        table[name] = {"baseline": base_value, "candidate": measured[name]["value"],
                       "difference": measured[name]["value"] - base_value if base_value is not None else None,
                       "worse_by": mean, "worse_ci": [lo, metrics.t_interval(worse, 1 - 2 * alpha)[2]]}
        checks.append(Check(f"{name} not significantly worse than baseline", "baseline", name, mean, 0.0, "<=",
                            not lo > 0, -lo, f"one-sided paired t over windows, alpha={alpha}"))
    return checks, table


def run(cfg: GateConfig, precision: str, measured: dict, windows: dict, provenance: dict) -> dict:
    merged = thresholds_for(cfg, precision)
    warnings: list[str] = []
    checks = _threshold_checks(merged, measured)
    section: dict = {"thresholds": {k: asdict(v) for k, v in merged.items()}}
    if cfg.statistical.enabled:
        stat_checks, section["statistical"] = _statistical(cfg, merged, windows, warnings)
        checks += stat_checks
    if cfg.baseline:
        base = load_baseline(cfg.baseline, provenance)
        base_checks, section["baseline"] = _baseline_checks(base, windows, measured, cfg.baseline_alpha)
        section["baseline"]["path"] = cfg.baseline
        checks += base_checks
    section.update(passed=all(c.passed for c in checks), checks=[asdict(c) for c in checks], warnings=warnings)
    return section
