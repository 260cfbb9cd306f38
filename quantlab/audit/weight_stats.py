"""The statistics of one dequantized weight against the reference (cosine, SQNR, gain, column spread): shared by the
per-layer check (quantlab.audit.weights) and the smoothing-pair analysis (quantlab.audit.equivalence)."""
from __future__ import annotations

import math

from quantlab.audit.bounds import GAIN_CAP, SQNR_CAP


def weight_stats(ref, eff) -> dict:
    """cosine, SQNR (dB), gain (the factor that best maps eff onto ref) and column spread of an effective dequantized
    weight against the reference weight. Column spread: the robust standard deviation (1.4826 x median absolute
    deviation) of log c_j over the input columns, c_j the factor that best maps column j of eff onto the reference's
    (columns holding real weight only); near 0 when healthy, the spread of the smoothing factors when a
    pre_quant_scale is missing. Per-column sums of the products (_column_dots), the totals summed in float64
    (the error energy as aa - 2 ab + bb: its rounding, ~1e-7 of aa, is far below every bound)."""
    import torch

    a, b = ref.float(), eff.float()
    if a.dim() != 2:
        a, b = a.reshape(1, -1), b.reshape(1, -1)
    rr, ee, re = (_column_dots(x, y) for x, y in ((a, a), (b, b), (a, b)))
    aa, bb, ab = (float(v.sum(dtype=torch.float64)) for v in (rr, ee, re))
    dd = max(aa - 2 * ab + bb, 0.0)
    cosine = ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 else 0.0
    sqnr = 10 * math.log10(aa / dd) if dd > 0 and aa > 0 else (SQNR_CAP if aa > 0 else -SQNR_CAP)
    gain = ab / bb if bb > 0 else GAIN_CAP  # an all-zero dequantized weight: no factor maps it back
    spread = column_spread(rr, ee, re) if ref.dim() == 2 else 0.0
    if not all(math.isfinite(x) for x in (cosine, sqnr, gain, spread)):  # NaN / Inf in the weights: nothing matches
        cosine, sqnr, gain, spread = 0.0, -SQNR_CAP, GAIN_CAP, GAIN_CAP
    return {"cosine": round(min(cosine, 1.0), 6), "sqnr_db": round(max(-SQNR_CAP, min(sqnr, SQNR_CAP)), 3),
            "gain": round(max(-GAIN_CAP, min(gain, GAIN_CAP)), 5), "column_spread": round(min(spread, GAIN_CAP), 5)}


DOT_ELEMENTS = 1 << 22  # products formed at a time: a temporary of 16 MB whatever the layer's size


def _column_dots(x, y):
    """sum_i x_ij y_ij for every column j, over groups of rows of about DOT_ELEMENTS products (torch's einsum of
    this form was 30-70x slower on a CPU: a batched matmul of one-element outputs)."""
    rows = max(1, DOT_ELEMENTS // max(1, x.shape[1]))
    out = (x[:rows] * y[:rows]).sum(0)
    for i in range(rows, x.shape[0], rows):
        out += (x[i: i + rows] * y[i: i + rows]).sum(0)
    return out


def column_spread(rr, ee, re) -> float:
    """Robust spread of log(re_j / ee_j) over the columns with real weight (rr, ee, re: per-column sums)."""
    import torch

    keep = (rr > 1e-6 * float(rr.median())) & (ee > 0) & (re > 0)
    if int(keep.sum()) < 2:
        return 0.0
    logc = torch.log(re[keep] / ee[keep])
    return float(1.4826 * (logc - logc.median()).abs().median())


# int4 formats whose weights are codes in [-8, 7] times a per-group scale of amax / 7 along the input dimension
INT4_GROUP_FORMATS = ("W4A16_AWQ", "W4A8_AWQ")


def format_baseline(space, quant_algo: str, group_size: int | None) -> dict | None:
    """What the format's own round-to-nearest makes of this weight (given in the quantizer's space, smoothing
    applied): the statistics of a healthy export of exactly this layer, against which a layer beyond the format's
    general bounds is judged (an outlier-heavy layer quantizes worse than the models the bounds came from, and is
    not broken for it). None for formats without a baseline here."""
    import torch

    if quant_algo not in INT4_GROUP_FORMATS or not group_size or space.dim() != 2 or space.shape[1] % group_size:
        return None
    w = space.float().reshape(space.shape[0], -1, group_size)
    scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 7
    rtn = (torch.round(w / scale).clamp(-8, 7) * scale).reshape(space.shape)
    return weight_stats(space, rtn)


SQNR_SLACK_DB, COSINE_SLACK, SPREAD_SLACK = 1.0, 0.01, 0.02  # an export this close to its format's own RTN is as good


def as_good_as_format(row: dict) -> bool:
    """Whether a layer's statistics are as good as its format's own round-to-nearest of the same weights
    (row["format_rtn"], format_baseline()): within 1 dB of SQNR, 0.01 of cosine, a column spread at most 1.25x + 0.02
    of it, and the same gain within 5% (cosine and spread do not see a constant scale error, and on a layer this
    noisy the SQNR slack would absorb one of 15-25%). Never for non-finite statistics."""
    from quantlab.audit.bounds import GAIN_WARN

    base = row.get("format_rtn")
    if not base or base["sqnr_db"] <= -SQNR_CAP + 1 or base["cosine"] <= 0 or base["gain"] <= 0:
        return False
    return row["sqnr_db"] >= base["sqnr_db"] - SQNR_SLACK_DB \
        and row["cosine"] >= base["cosine"] - COSINE_SLACK \
        and row["column_spread"] <= 1.25 * base["column_spread"] + SPREAD_SLACK \
        and abs(row["gain"] / base["gain"] - 1) <= GAIN_WARN
