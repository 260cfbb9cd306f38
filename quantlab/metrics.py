"""Metric definitions: pure functions over logits / ids, and the registry the gates read.

Conventions (README "Metrics" has the same text):
- A window of T tokens gives T-1 predicted positions (position t predicts token t+1).
- NLL in nats, from log_softmax in float32. ppl = exp(sum NLL / number of predicted tokens).
- Windows, not tokens, are the independent units for confidence intervals (t-intervals over windows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from quantlab.registry import Registry

METRICS_SCHEMA = "quantlab.metrics/1"  # the schema string of metrics.json (quantlab.report.documents.MetricsDoc)


@dataclass(frozen=True)
class MetricSpec:
    """What the gate and the reports need to know about a metric: its direction, its ideal value (the reference
    against itself), its range, whether a gate may threshold it and whether the summary tables show it."""

    higher_is_better: bool
    definition: str
    ideal: float | None = None
    gateable: bool = True
    in_table: bool = True
    range: tuple[float, float] = (-math.inf, math.inf)

    def loss(self, value: float) -> float:
        """How far from ideal, in the metric's units, positive when worse (attribution adds these up)."""
        return (self.ideal - value) if self.higher_is_better else (value - self.ideal)


METRICS: Registry[MetricSpec] = Registry("metric", "gate.thresholds.METRIC")
METRICS.add("top1_agreement", MetricSpec(True, "share of predicted positions where argmax(candidate) == "
                                               "argmax(reference), teacher-forced", 1.0, range=(0.0, 1.0)))
METRICS.add("ppl_reference", MetricSpec(False, "exp(sum NLL_ref / predicted tokens) over non-overlapping windows",
                                        gateable=False, range=(1.0, math.inf)))
METRICS.add("ppl_candidate", MetricSpec(False, "exp(sum NLL_cand / predicted tokens) over the same windows",
                                        range=(1.0, math.inf)))
METRICS.add("ppl_ratio", MetricSpec(False, "ppl_candidate / ppl_reference = exp(mean over tokens of NLL_cand - NLL_ref)",
                                    1.0, range=(0.0, math.inf)))
METRICS.add("dnll_mean", MetricSpec(False, "mean per-token NLL_cand - NLL_ref (nats); CI paired over windows", 0.0,
                                    in_table=False))
METRICS.add("kl_mean", MetricSpec(False, "mean over positions of KL(ref || cand) on the reference's top-k tokens plus "
                                         "one tail bin (a lower bound of the full-vocabulary KL, equal when the tail "
                                         "mass is ~0)", 0.0, range=(0.0, math.inf)))
METRICS.add("kl_p90", MetricSpec(False, "90th percentile over positions of the same per-position KL", 0.0,
                                 in_table=False, range=(0.0, math.inf)))
METRICS.add("kl_p99", MetricSpec(False, "99th percentile over positions of the same per-position KL", 0.0,
                                 range=(0.0, math.inf)))
METRICS.add("ref_tail_mass", MetricSpec(False, "mean reference probability outside its top-k (how tight the KL bound "
                                               "is)", 0.0, gateable=False, in_table=False, range=(0.0, 1.0)))
METRICS.add("gen_exact_match", MetricSpec(True, "share of prompts whose greedy continuation (N new tokens) is "
                                                "identical", 1.0, range=(0.0, 1.0)))
METRICS.add("gen_first_divergence", MetricSpec(True, "mean index of the first differing generated token (N when "
                                                     "identical)", range=(0.0, math.inf)))
GATEABLE = [name for name, spec in METRICS.items() if spec.gateable]
TABLE = [name for name, spec in METRICS.items() if spec.in_table]


# ------------------------------------------------------------------------------------ per position
# Part of the reference and evaluation cache keys: outputs computed by another formula are never mixed.
# 2: log p = logits - logsumexp (was log_softmax, which carries a -8e-6 nats/token rounding bias in fp32)
FORMULA_VERSION = 2


class PositionStats:
    """Per-position statistics of next-token logits [B,T,V] against targets [B,T-1] (the last position predicts
    nothing): .nll and .argmax [B,T-1], .topk(k), .at(ids). Log-probabilities are log_softmax(logits) = logits - logsumexp(logits), formed only where asked
    for (the targets, the top-k, the reference's top-k indices), so no [B,T,V] log-prob tensor is materialized."""

    def __init__(self, logits, targets):
        import torch

        self.logits = logits[:, :-1].float()
        self.lse = torch.logsumexp(self.logits, dim=-1)
        self.nll = self.lse - self.logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        self.argmax = self.logits.argmax(-1)

    def at(self, idx):
        """log p of the token ids idx [B,T-1,k]."""
        return self.logits.gather(-1, idx.long()) - self.lse.unsqueeze(-1)

    def topk(self, k: int):
        """(log p, ids) of the k most likely tokens per position."""
        values, idx = self.logits.topk(k, dim=-1)
        return values - self.lse.unsqueeze(-1), idx


def topk_kl(ref_lp_top, cand_lp_top):
    """KL(ref || cand) over the reference's top-k tokens plus one bin for the remaining mass.

    ref_lp_top: [..., k] reference log-probs of its top-k tokens; cand_lp_top: [..., k] the candidate's
    log-probs of the same tokens. Returns [...] in float32. By the data-processing inequality this never
    exceeds the full KL and equals it when the tail mass is 0.
    """
    import torch

    ref_lp = ref_lp_top.double()
    cand_top = cand_lp_top.double()
    p_ref = ref_lp.exp()
    head = (p_ref * (ref_lp - cand_top)).sum(-1)
    tail_ref = 1.0 - p_ref.sum(-1)
    tail_ref = torch.where(tail_ref > 1e-6, tail_ref, torch.zeros_like(tail_ref))  # below fp32 resolution: rounding
    tail_cand = (1.0 - cand_top.exp().sum(-1)).clamp_min(1e-30)
    tail = torch.where(tail_ref > 0, tail_ref * (tail_ref.clamp_min(1e-30).log() - tail_cand.log()), torch.zeros_like(tail_ref))
    return (head + tail).clamp_min(0.0).float()


# --------------------------------------------------------------------------------------- statistics
def t_interval(values, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi) of a t-interval over independent units; degenerate when n < 2."""
    from scipy import stats

    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    if v.size < 2 or float(v.std(ddof=1)) == 0.0:
        return mean, mean, mean
    half = float(stats.t.ppf(0.5 + confidence / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))
    return mean, mean - half, mean + half


def wilson_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Score interval for a proportion; stays inside [0, 1] and is sane for small n."""
    if n == 0:
        return 0.0, 1.0
    zz = z(0.5 + confidence / 2)
    p = successes / n
    denom = 1 + zz * zz / n
    centre = (p + zz * zz / (2 * n)) / denom
    half = zz * math.sqrt(p * (1 - p) / n + zz * zz / (4 * n * n)) / denom
    lo = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact ends: the formula gives 0 / 1 up to rounding
    hi = 1.0 if successes >= n else min(1.0, centre + half)
    return lo, hi


def z(p: float) -> float:
    from scipy import stats

    return float(stats.norm.ppf(p))


def statistical_threshold(ref_value: float, sigma: float, n: int, alpha: float, beta: float,
                          higher_is_better: bool) -> tuple[float, float]:
    """TensorRT-LLM accuracy-suite style: threshold = ref -/+ z_alpha*sqrt(2 sigma^2/n),
    detectable effect theta = (z_alpha + z_beta)*sqrt(2 sigma^2/n) (as a magnitude)."""
    se = math.sqrt(2.0 * sigma * sigma / n)
    za, zb = z(1 - alpha), z(1 - beta)
    threshold = ref_value - za * se if higher_is_better else ref_value + za * se
    return threshold, (za + zb) * se


def windows_needed(sigma: float, effect: float, alpha: float, beta: float) -> int:
    """Smallest n for which the statistical test detects `effect` with power 1 - beta."""
    if effect <= 0:
        return 0
    return math.ceil(2.0 * sigma * sigma * (z(1 - alpha) + z(1 - beta)) ** 2 / (effect * effect))


# ----------------------------------------------------------------------------------------- summary
def summarize(w: dict, positions_kl: np.ndarray, gen: dict | None, tail_mass: float) -> dict:
    """Window arrays -> metrics with 95% CIs. w holds per-window sums/counts (numpy arrays)."""
    n_tok = w["n_pred"].astype(np.float64)
    nll_r = w["nll_ref"] / n_tok
    nll_c = w["nll_cand"] / n_tok
    out: dict[str, dict] = {}

    def put(name, value, ci=None, **extra):
        entry = {"value": float(value), "higher_is_better": METRICS[name].higher_is_better}
        if ci is not None:
            entry["ci95"] = [float(ci[0]), float(ci[1])]
        entry.update(extra)
        out[name] = entry

    total = n_tok.sum()
    _, lo, hi = t_interval(nll_r)
    put("ppl_reference", math.exp(w["nll_ref"].sum() / total), (math.exp(lo), math.exp(hi)))
    _, lo, hi = t_interval(nll_c)
    put("ppl_candidate", math.exp(w["nll_cand"].sum() / total), (math.exp(lo), math.exp(hi)))
    dn = nll_c - nll_r
    mean_dn = float((w["nll_cand"].sum() - w["nll_ref"].sum()) / total)
    _, lo, hi = t_interval(dn)
    put("ppl_ratio", math.exp(mean_dn), (math.exp(lo), math.exp(hi)))
    put("dnll_mean", mean_dn, (lo, hi))
    _, lo, hi = t_interval(w["agree"] / n_tok)
    put("top1_agreement", w["agree"].sum() / total, (max(lo, 0.0), min(hi, 1.0)))
    _, lo, hi = t_interval(w["kl"] / n_tok)
    put("kl_mean", w["kl"].sum() / total, (max(lo, 0.0), hi))
    put("kl_p90", float(np.quantile(positions_kl, 0.90)))
    put("kl_p99", float(np.quantile(positions_kl, 0.99)))
    put("ref_tail_mass", tail_mass)
    if gen and gen["first_divergence"]:
        fd = np.asarray(gen["first_divergence"], dtype=np.float64)
        n_new = gen["new_tokens"]
        exact = int((fd >= n_new).sum())
        put("gen_exact_match", exact / fd.size, wilson_interval(exact, fd.size), prompts=int(fd.size))
        _, lo, hi = t_interval(fd)
        put("gen_first_divergence", fd.mean(), (max(lo, 0.0), min(hi, float(n_new))), new_tokens=n_new)
    return out


def first_divergence(a, b) -> int:
    """Index of the first differing element of two equal-length id sequences (len when identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
