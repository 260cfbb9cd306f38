"""Metric definitions: pure functions over logits / ids, and the registry the gates and reports read.

Conventions (README "Metrics" has the same text):
- A window of T tokens gives T-1 predicted positions (position t predicts token t+1).
- log p = logits - logsumexp(logits) in float32, over the full vocabulary of both models (the reference's logits
  are recomputed from its cached final hidden states), so every KL here is exact, not a top-k bound.
- Documents, not tokens or windows, are the independent units of every interval (quantlab.gate.stats); a window
  belongs to the document holding most of its tokens (quantlab.stages.data).
- The KL and probability statistics follow the definitions of llama.cpp's `llama-perplexity --kl-divergence`
  (KL(ref || cand) per position; delta-p = p_cand(token) - p_ref(token) of the correct next token; "same top" =
  top-1 agreement; percentiles by linear interpolation), so the numbers are comparable across tools. quantlab also
  reports delta-p of the reference's top token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from quantlab.registry import Registry

METRICS_SCHEMA = "quantlab.metrics/2"  # the schema string of metrics.json (quantlab.report.documents.MetricsDoc)
# Part of the reference and evaluation cache keys: outputs computed by another formula are never mixed.
# 2: log p = logits - logsumexp (was log_softmax, which carries a -8e-6 nats/token rounding bias in fp32)
# 3: exact full-vocabulary KL from cached reference hidden states; per-position arrays per block of windows
# 4: MoE router top-k ids kept in reference blocks (router agreement)
FORMULA_VERSION = 4


@dataclass(frozen=True)
class MetricSpec:
    """What the gate and the reports need to know about a metric: its direction, its ideal value (the reference
    against itself), its range, whether a gate may threshold it and whether the summary tables show it.
    `quantile` marks a percentile over positions (its gate test is the share of positions above the threshold)."""

    higher_is_better: bool
    definition: str
    ideal: float | None = None
    gateable: bool = True
    in_table: bool = True
    range: tuple[float, float] = (-math.inf, math.inf)
    quantile: float | None = None
    unit: str = ""
    log_scale: bool = False  # tested as a mean of log values (perplexities): a threshold must be > 0
    tail_of: str | None = None  # a tail check: share of windows whose per-window mean of this quantity > `above`
    tail_words: str = ""  # tail checks: what `above` bounds, in words ("mean KL", "ppl ratio", ...)
    tail_ratio: bool = False  # tail checks: `above` is a per-window ratio of perplexities, exp(mean dNLL)
    tail_range: tuple[float, float] = (0.0, math.inf)  # tail checks: `above` strictly inside this range
    tail_example: float = 0.5  # tail checks: the `above` an error message suggests (the default gate's)

    def tail_value(self, per_window):
        """The per-window values a tail check compares with `above` (a ratio of perplexities: exp of mean dNLL)."""
        if not self.tail_ratio:
            return per_window
        with np.errstate(over="ignore"):  # a broken window's ratio may overflow to inf: beyond every bound
            return np.exp(per_window)

    def loss(self, value: float) -> float:
        """How far from ideal, in the metric's units, positive when worse (attribution adds these up)."""
        return (self.ideal - value) if self.higher_is_better else (value - self.ideal)


METRICS: Registry[MetricSpec] = Registry("metric", "gate.thresholds.METRIC")
_P = (0.0, 1.0)
_POS = (0.0, math.inf)
for _name, _spec in {
    "top1_agreement": MetricSpec(True, "share of predicted positions where argmax(candidate) == argmax(reference), "
                                       "teacher-forced (llama.cpp: 'Same top p')", 1.0, range=_P),
    "ppl_reference": MetricSpec(False, "exp(sum NLL_ref / predicted tokens) over the evaluated windows", gateable=False,
                                range=(1.0, math.inf)),
    "ppl_candidate": MetricSpec(False, "exp(sum NLL_cand / predicted tokens) over the same windows (not a paired "
                                       "comparison: prefer ppl_ratio)", range=(1.0, math.inf), log_scale=True),
    "ppl_ratio": MetricSpec(False, "ppl_candidate / ppl_reference = exp(mean over tokens of NLL_cand - NLL_ref)", 1.0,
                            range=(0.0, math.inf), log_scale=True),
    "dnll_mean": MetricSpec(False, "mean per-token NLL_cand - NLL_ref (nats)", 0.0, in_table=False, unit="nats"),
    "kl_mean": MetricSpec(False, "mean over positions of KL(ref || cand) over the full vocabulary (nats)", 0.0,
                          range=_POS, unit="nats"),
    "kl_median": MetricSpec(False, "median over positions of the same per-position KL", 0.0, in_table=False,
                            range=_POS, quantile=0.5, unit="nats"),
    "kl_p90": MetricSpec(False, "90th percentile over positions of the per-position KL", 0.0, in_table=False,
                         range=_POS, quantile=0.9, unit="nats"),
    "kl_p99": MetricSpec(False, "99th percentile over positions of the per-position KL", 0.0, range=_POS, quantile=0.99,
                         unit="nats"),
    "kl_p999": MetricSpec(False, "99.9th percentile over positions of the per-position KL", 0.0, in_table=False,
                          range=_POS, quantile=0.999, unit="nats"),
    "kl_max": MetricSpec(False, "largest per-position KL", 0.0, gateable=False, in_table=False, range=_POS),
    "kl_tail": MetricSpec(False, "share of windows whose mean KL exceeds the threshold's `above` bound (a tail check: "
                                 "a candidate broken on a few percent of the text fails it)", 0.0, in_table=False,
                          range=_P, unit="share of windows", tail_of="kl", tail_words="mean KL"),
    "ppl_tail": MetricSpec(False, "share of windows whose perplexity ratio exp(mean NLL_cand - NLL_ref) exceeds the "
                                  "threshold's `above` bound (a tail check: a candidate whose perplexity is fine on "
                                  "average and broken on a few percent of the text fails it)", 0.0, in_table=False,
                           range=_P, unit="share of windows", tail_of="dnll", tail_words="ppl ratio",
                           tail_ratio=True, tail_range=(1.0, math.inf), tail_example=1.21),
    "top1_tail": MetricSpec(False, "share of windows whose top-1 disagreement (1 - top-1 agreement) exceeds the "
                                   "threshold's `above` bound (a tail check)", 0.0, in_table=False, range=_P,
                            unit="share of windows", tail_of="disagree", tail_words="top-1 disagreement",
                            tail_range=(0.0, 1.0), tail_example=0.4),
    "dp_true_mean": MetricSpec(True, "mean over positions of p_cand(correct token) - p_ref(correct token) "
                                     "(llama.cpp's mean delta-p)", 0.0, in_table=False, range=(-1.0, 1.0)),
    "dp_true_rms": MetricSpec(False, "root mean square of the same delta-p", 0.0, gateable=False, in_table=False,
                              range=_P),
    "flip_rate": MetricSpec(False, "share of positions whose top-1 changed from right to wrong or wrong to right "
                                   "(relative to the true next token)", 0.0, in_table=False, range=_P),
    "net_flip_rate": MetricSpec(False, "(right->wrong - wrong->right) / positions: top-1 accuracy lost", 0.0,
                                in_table=False, range=(-1.0, 1.0)),
    "router_topk_agreement": MetricSpec(True, "MoE models: share of (position, MoE layer) pairs where the candidate "
                                              "routes to the same set of top-k experts as the reference", 1.0,
                                        range=_P),
    "gen_exact_match": MetricSpec(True, "share of prompts whose greedy continuation (N new tokens) is identical",
                                  1.0, range=_P),
    "gen_first_divergence": MetricSpec(True, "mean index of the first differing generated token (N when identical)",
                                       range=_POS),
}.items():
    METRICS.add(_name, _spec)
GATEABLE = [name for name, spec in METRICS.items() if spec.gateable]
TABLE = [name for name, spec in METRICS.items() if spec.in_table]
PERCENTILES = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999)
BUCKET_EDGES = (0, 128, 512, 2048, 8192, 32768, 131072, 524288)


# ------------------------------------------------------------------------------------------ per position
# The arrays one comparison produces per predicted position, and their storage dtypes.
POSITION_FIELDS = {"nll_ref": "float32", "nll_cand": "float32", "kl": "float32", "dp_true": "float32",
                   "dp_top": "float32", "argmax_ref": "int32", "argmax_cand": "int32"}


COMPARE_ELEMENTS = 1 << 19  # logits compared at a time on a CPU: the temporaries stay in cache (3-12x faster at 2-67M)


def compare_positions(ref_logits, cand_logits, targets) -> dict:
    """_compare_rows over [B, C, V] logits; on a CPU in groups of rows of about COMPARE_ELEMENTS logits (row by row
    the same arithmetic: identical results), so a large vocabulary's chunk never allocates its temporaries at full
    size (Gemma-3's 262k x 254 positions of the audit's canary: 1.6 s at once, 0.13 s in groups)."""
    import torch

    shape, vocab = targets.shape, ref_logits.shape[-1]
    rows = max(1, COMPARE_ELEMENTS // max(1, vocab))
    flat = int(targets.numel())
    if ref_logits.device.type != "cpu" or flat <= rows:
        return _compare_rows(ref_logits, cand_logits, targets)
    r, c, t = ref_logits.reshape(flat, vocab), cand_logits.reshape(flat, vocab), targets.reshape(flat)
    parts = [_compare_rows(r[i: i + rows], c[i: i + rows], t[i: i + rows]) for i in range(0, flat, rows)]
    return {k: torch.cat([p[k] for p in parts]).reshape(shape) for k in parts[0]}


def _compare_rows(ref_logits, cand_logits, targets) -> dict:
    """Per-position comparison of two [B, C, V] logit chunks on the same inputs (targets [B, C] are the correct next
    tokens): NLLs, exact KL(ref || cand) over the full vocabulary, delta-p of the correct token and of the
    reference's top token, both argmaxes.

    The KL is a small difference of large sums; it is formed without cancellation in float32 as
    KL = sum_v p_v (d_v - d_top) + log(S_c / S_r), d = ref - cand logits, d_top = d at the reference's top token,
    S_r = sum exp(ref - max_ref), S_c = sum exp(cand - max_ref - d_top): absolute error ~2e-7 nats (vs float64,
    tested), 2.6x faster than float64 on CPU. A chunk whose candidate logits would overflow that form (a broken
    candidate) is computed in float64 instead."""
    import torch

    r, c = ref_logits.float(), cand_logits.float()
    t = targets.long().unsqueeze(-1)
    am_r = r.argmax(-1, keepdim=True)
    m = r.gather(-1, am_r)
    er = torch.exp(r - m)
    sr = er.sum(-1, keepdim=True)
    d = r - c
    d_top = d.gather(-1, am_r)
    ec = er * torch.exp(d_top - d)
    sc = ec.sum(-1, keepdim=True)
    if not bool(torch.isfinite(sc).all()):
        return _compare_positions_f64(ref_logits, cand_logits, targets)
    kl = ((er / sr) * (d - d_top)).sum(-1) + torch.log(sc / sr)[..., 0]
    lse_r = m + torch.log(sr)
    lse_c = m - d_top + torch.log(sc)
    lp_r_t, lp_c_t = r.gather(-1, t) - lse_r, c.gather(-1, t) - lse_c
    lp_r_top, lp_c_top = -torch.log(sr), c.gather(-1, am_r) - lse_c
    return {"nll_ref": -lp_r_t[..., 0], "nll_cand": -lp_c_t[..., 0], "kl": kl.clamp_min(0.0),
            "dp_true": (lp_c_t.exp() - lp_r_t.exp())[..., 0], "dp_top": (lp_c_top.exp() - lp_r_top.exp())[..., 0],
            "argmax_ref": am_r[..., 0].int(), "argmax_cand": c.argmax(-1).int()}


def _compare_positions_f64(ref_logits, cand_logits, targets) -> dict:
    import torch

    r, c = ref_logits.double(), cand_logits.double()
    t = targets.long().unsqueeze(-1)
    lp_r = r - torch.logsumexp(r, -1, keepdim=True)
    lp_c = c - torch.logsumexp(c, -1, keepdim=True)
    kl = (lp_r.exp() * (lp_r - lp_c)).sum(-1).clamp_min(0.0).float()
    top = ref_logits.argmax(-1, keepdim=True)
    return {"nll_ref": (-lp_r.gather(-1, t)[..., 0]).float(), "nll_cand": (-lp_c.gather(-1, t)[..., 0]).float(),
            "kl": kl, "dp_true": (lp_c.gather(-1, t)[..., 0].exp() - lp_r.gather(-1, t)[..., 0].exp()).float(),
            "dp_top": (lp_c.gather(-1, top)[..., 0].exp() - lp_r.gather(-1, top)[..., 0].exp()).float(),
            "argmax_ref": top[..., 0].int(), "argmax_cand": cand_logits.argmax(-1).int()}


def compare_sparse(ref_logits, target_lp, top_ids, top_lp, targets) -> dict:
    """compare_positions for a candidate known only by sparse log-probs (a server, quantlab.engines.served): the
    target token's log-prob target_lp [B, C] (NLL, delta-p exact), its top k ids / log-probs [B, C, k] in descending
    order (-1 / -inf: none; top-1 agreement exact).

    KL(ref || cand) is the KL of both distributions collapsed onto S = the served top k plus the target, and one
    bucket for the rest: sum_{v in S} P_v log(P_v / Q_v) + P_out log(P_out / Q_out), P_out = 1 - P(S),
    Q_out = 1 - Q(S). By the log-sum inequality it is a lower bound of the full-vocabulary KL, equal to it when the
    reference puts no mass outside S, and the gap is sum_{v not in S} P_v log(P_v / Q_v) - P_out log(P_out / Q_out):
    zero when the served distribution outside S is proportional to the reference's; no upper bound exists without
    the served probabilities outside S. `ref_out` (P_out per position) says how much the bound leaves open.
    dp_top: exact when the reference's top token is in S, else 0 (the served probability is <= the k-th)."""
    import torch

    lp_r = torch.log_softmax(ref_logits.double(), -1)
    t = targets.long()
    ids = torch.cat([top_ids.long(), t.unsqueeze(-1)], -1)
    q = torch.cat([top_lp.double(), target_lp.double().unsqueeze(-1)], -1)
    valid = ids >= 0
    dup = (ids[..., -1:] == ids[..., :-1]).any(-1)  # the target is among the top k already
    valid[..., -1] &= ~dup
    safe = ids.clamp_min(0)
    p_lp = lp_r.gather(-1, safe)
    pv = torch.where(valid, p_lp.exp(), torch.zeros_like(p_lp))
    qv = torch.where(valid, q.exp(), torch.zeros_like(q))
    inside = torch.where(valid & (pv > 0), pv * (p_lp - torch.where(valid, q, torch.zeros_like(q))),
                         torch.zeros_like(pv)).sum(-1)
    p_out = (1 - pv.sum(-1)).clamp_min(0.0)
    q_out = (1 - qv.sum(-1)).clamp_min(1e-300)
    outside = torch.where(p_out > 0, p_out * (torch.log(p_out.clamp_min(1e-300)) - torch.log(q_out)),
                          torch.zeros_like(p_out))
    kl = (inside + outside).clamp_min(0.0)
    am_r = lp_r.argmax(-1)
    in_top = (ids == am_r.unsqueeze(-1)) & valid
    q_top = torch.where(in_top, qv, torch.zeros_like(qv)).sum(-1)
    lp_r_t = lp_r.gather(-1, t.unsqueeze(-1))[..., 0]
    return {"nll_ref": (-lp_r_t).float(), "nll_cand": (-target_lp.double()).float(), "kl": kl.float(),
            "dp_true": (target_lp.double().exp() - lp_r_t.exp()).float(),
            "dp_top": (q_top - lp_r.gather(-1, am_r.unsqueeze(-1))[..., 0].exp()).float(),
            "argmax_ref": am_r.int(), "argmax_cand": top_ids[..., 0].int(), "ref_out": p_out.float()}


def router_agreement(ref_ids, cand_ids):
    """[B, T] share of MoE layers where the candidate's top-k expert set equals the reference's (ids sorted)."""
    return (ref_ids.to(cand_ids.device) == cand_ids).all(-1).float().mean(-1)


def nll_and_argmax(logits, targets):
    """(NLL of the targets, argmax) of one [B, C, V] chunk (the reference alone)."""
    import torch

    lf = logits.float()
    lse = torch.logsumexp(lf, -1)
    return lse - lf.gather(-1, targets.long().unsqueeze(-1))[..., 0], lf.argmax(-1).int()


def first_divergence(a, b) -> int:
    """Index of the first differing element of two equal-length id sequences (len when identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


# ---------------------------------------------------------------------------------------------- buckets
def bucket_bounds(positions: int) -> list[tuple[str, int, int]]:
    """(label, lo, hi) position buckets covering 0..positions (0-128, 128-512, 512-2k, 2k-8k, ...)."""

    def label(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)

    out = []
    for lo, hi in zip(BUCKET_EDGES, BUCKET_EDGES[1:], strict=False):
        if lo >= positions:
            break
        out.append((f"{label(lo)}-{label(hi)}", lo, min(hi, positions)))
    return out


# --------------------------------------------------------------------------------------------- per window
class Windows:
    """Per-position arrays [windows, positions] of one candidate (POSITION_FIELDS plus targets) and the per-window
    values every check is tested on."""

    def __init__(self, arrays: dict[str, np.ndarray], targets: np.ndarray, docs=None, labels=None, positions=None):
        self.a = arrays
        self.targets = targets
        self.n, self.t = targets.shape
        self.docs = None if docs is None else np.asarray(docs)[: self.n]  # document of each window (the clusters)
        self.labels = labels  # document -> label (reports)
        self.positions = None if positions is None else np.asarray(positions)[: self.n]  # window index in the text

    def head(self, n: int) -> Windows:
        """The first n windows."""
        return Windows({k: v[:n] for k, v in self.a.items()}, self.targets[:n], self.docs, self.labels,
                       self.positions)

    def columns(self, lo: int = 0, hi: int | None = None) -> Windows:
        """Positions lo..hi of every window (a bucket)."""
        return Windows({k: v[:, lo:hi] for k, v in self.a.items()}, self.targets[:, lo:hi], self.docs, self.labels,
                       self.positions)

    def clusters(self):
        """The windows' documents as quantlab.gate.stats.Clusters (None: every window its own document)."""
        from quantlab.gate import stats

        return None if self.docs is None else stats.Clusters(self.docs)

    def label(self, i: int) -> str:
        """Where window i is: its index in the text and its document's label."""
        where = f"window {int(self.positions[i])}" if self.positions is not None else f"window {i}"
        if self.docs is not None:
            doc = int(self.docs[i])
            where += f" ({(self.labels or {}).get(str(doc), f'document {doc}')})"
        return where

    def per_window(self, name: str) -> np.ndarray:
        """Per-window mean of a per-position quantity (or of a derived one: dnll, agree, disagree, flips)."""
        a = self.a
        if name == "dnll":
            v = a["nll_cand"].astype(np.float64) - a["nll_ref"]
        elif name == "agree":
            v = (a["argmax_cand"] == a["argmax_ref"]).astype(np.float64)
        elif name == "disagree":
            v = (a["argmax_cand"] != a["argmax_ref"]).astype(np.float64)
        elif name == "flip_rate":
            v = ((a["argmax_ref"] == self.targets) != (a["argmax_cand"] == self.targets)).astype(np.float64)
        elif name == "net_flip":
            ref_ok, cand_ok = a["argmax_ref"] == self.targets, a["argmax_cand"] == self.targets
            v = (ref_ok & ~cand_ok).astype(np.float64) - (~ref_ok & cand_ok)
        else:
            v = a[name].astype(np.float64)
        return v.mean(1)

    def exceedance(self, threshold: float) -> np.ndarray:
        """Per-window share of positions whose KL is above threshold (the test of a KL percentile)."""
        return (self.a["kl"] > threshold).mean(1).astype(np.float64)


# ------------------------------------------------------------------------------------------------ summary
def distribution(values: np.ndarray, scale: float = 1.0) -> dict:
    """llama.cpp-style summary of a per-position quantity: mean, RMS, min / max and percentiles (type 7)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    out = {"mean": float(v.mean()) * scale, "rms": float(np.sqrt((v * v).mean())) * scale,
           "min": float(v.min()) * scale, "max": float(v.max()) * scale}
    out.update({f"p{q * 100:g}": float(np.quantile(v, q)) * scale for q in PERCENTILES})
    return out


def summarize(w: Windows, gen: dict | None = None, confidence: float = 0.95) -> dict:
    """Window arrays -> every metric with its value and a 95% interval (paired: the per-window differences of
    candidate and reference; the windows' documents as clusters, as the gate's intervals: stats.clustered_interval;
    percentiles by a bootstrap over windows)."""
    from quantlab.gate import stats

    out: dict[str, dict] = {}

    def put(name, value, ci=None, **extra):
        spec = METRICS[name]
        entry = {"value": float(value), "higher_is_better": spec.higher_is_better}
        if ci is not None:
            lo, hi = spec.range
            entry["ci95"] = [float(max(ci[0], lo)), float(min(ci[1], hi))]
        entry.update(extra)
        out[name] = entry

    nll_r, nll_c = w.per_window("nll_ref"), w.per_window("nll_cand")
    dn = nll_c - nll_r
    clusters = w.clusters()

    def ci(values):
        return stats.clustered_interval(values, clusters, confidence)

    _, lo, hi = ci(nll_r)
    put("ppl_reference", math.exp(nll_r.mean()), (math.exp(lo), math.exp(hi)))
    _, lo, hi = ci(nll_c)
    put("ppl_candidate", math.exp(nll_c.mean()), (math.exp(lo), math.exp(hi)))
    mean, lo, hi = ci(dn)
    put("ppl_ratio", math.exp(mean), (math.exp(lo), math.exp(hi)))
    put("dnll_mean", mean, (lo, hi))
    keys = [("top1_agreement", "agree"), ("kl_mean", "kl"), ("dp_true_mean", "dp_true"), ("flip_rate", "flip_rate"),
            ("net_flip_rate", "net_flip")]
    if "router_agree" in w.a:
        keys.append(("router_topk_agreement", "router_agree"))
    for name, key in keys:
        mean, lo, hi = ci(w.per_window(key))
        put(name, mean, (lo, hi))
    kl_rows = list(w.a["kl"].astype(np.float64))
    for name in ("kl_median", "kl_p90", "kl_p99", "kl_p999"):
        q = METRICS[name].quantile
        ci = stats.cluster_bootstrap(kl_rows, lambda v, q=q: float(np.quantile(v, q)), confidence)
        put(name, stats.percentile(w.a["kl"], q), ci)
    put("kl_max", float(w.a["kl"].max()))
    dp = w.a["dp_true"].astype(np.float64)
    put("dp_true_rms", float(np.sqrt((dp * dp).mean())))
    if gen and gen.get("first_divergence"):
        fd = np.asarray(gen["first_divergence"], dtype=np.float64)
        n_new = gen["new_tokens"]
        exact = int((fd >= n_new).sum())
        put("gen_exact_match", exact / fd.size, stats.wilson_interval(exact, fd.size, confidence), prompts=int(fd.size))
        _, lo, hi = stats.t_interval(fd, confidence)
        put("gen_first_divergence", fd.mean(), (max(lo, 0.0), min(hi, float(n_new))), new_tokens=n_new)
    return out


def behaviour(w: Windows) -> dict:
    """The behaviour panel: KL distribution, delta-p distributions (correct token, reference's top token) with the
    share that went up or down, top-1 flips relative to the correct token with McNemar's tests."""
    from quantlab.gate import stats

    ref_ok, cand_ok = w.a["argmax_ref"] == w.targets, w.a["argmax_cand"] == w.targets
    b_w, c_w = (ref_ok & ~cand_ok).sum(1), (~ref_ok & cand_ok).sum(1)
    b, c = int(b_w.sum()), int(c_w.sum())
    z_clustered, p_clustered = stats.clustered_mcnemar(b_w, c_w)
    panel = {"positions": int(w.n * w.t), "windows": int(w.n),
             "kl": distribution(w.a["kl"]),
             "dp_true": {**distribution(w.a["dp_true"]), "share_up": float((w.a["dp_true"] > 0).mean()),
                         "share_down": float((w.a["dp_true"] < 0).mean())},
             "dp_top": {**distribution(w.a["dp_top"]), "share_up": float((w.a["dp_top"] > 0).mean()),
                        "share_down": float((w.a["dp_top"] < 0).mean())},
             "flips": {"ref_right_cand_wrong": b, "ref_wrong_cand_right": c, "net": b - c,
                       "ref_accuracy": float(ref_ok.mean()), "cand_accuracy": float(cand_ok.mean()),
                       "mcnemar_exact_p": stats.mcnemar(b, c), "mcnemar_clustered_z": z_clustered,
                       "mcnemar_clustered_p": p_clustered,
                       "note": "exact McNemar treats positions as independent; the clustered test (Obuchowski) "
                               "uses windows as clusters and is the one to trust"}}
    return panel


def buckets(w: Windows, confidence: float = 0.95) -> list[dict]:
    """Every metric per position bucket (0-128, 128-512, ...), with intervals over windows."""
    from quantlab.gate import stats

    out = []
    for label, lo, hi in bucket_bounds(w.t):
        sub = w.columns(lo, hi)
        row = {"bucket": label, "lo": lo, "hi": hi, "positions": int(sub.n * (hi - lo))}
        for name, key, transform in (("ppl_ratio", "dnll", math.exp), ("top1_agreement", "agree", None),
                                     ("kl_mean", "kl", None), ("dp_true_mean", "dp_true", None)):
            mean, a, b = stats.t_interval(sub.per_window(key), confidence)
            f = transform or (lambda x: x)
            row[name] = {"value": f(mean), "ci95": [f(a), f(b)]}
        row["kl_p99"] = {"value": stats.percentile(sub.a["kl"], 0.99)}
        out.append(row)
    return out
