"""gate: thresholds, a statistical test and an optional baseline regression check -> verdict + reasons.

Every check is evaluated and reported (not only the first failure), each with value, threshold and margin.
Directions come from the metric registry (`higher_is_better`), never from branches on names.
"""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from quantlab import metrics
from quantlab.config import PRECISION_SCHEMAS, GateConfig, Threshold
from quantlab.errors import QuantlabError

METRICS_SCHEMA = "quantlab.metrics/1"


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


def _closest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def thresholds_for(cfg: GateConfig, precision: str) -> dict[str, Threshold]:
    for name in cfg.per_precision:
        if name not in PRECISION_SCHEMAS:
            raise QuantlabError(f"gate.per_precision has unknown precision {name!r}{_closest(name, PRECISION_SCHEMAS)}",
                                fix=f"use one of {', '.join(PRECISION_SCHEMAS)}")
    merged = {**cfg.thresholds, **cfg.per_precision.get(precision, {})}
    # OmegaConf leaves dataclasses nested two dicts deep as plain dicts
    merged = {k: v if isinstance(v, Threshold) else Threshold(**v) for k, v in merged.items()}
    gateable = [m for m, info in metrics.REGISTRY.items() if info.gateable]
    for name in merged:
        if name not in gateable:
            raise QuantlabError(f"gate threshold on unknown metric {name!r}{_closest(name, gateable)}",
                                fix=f"gateable metrics: {', '.join(gateable)}")
    return merged


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
        hib = metrics.REGISTRY[name].higher_is_better
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
