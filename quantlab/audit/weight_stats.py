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
    pre_quant_scale is missing. Per-column sums of the products (one pass each, no temporaries), the totals summed
    in float64 (the error energy as aa - 2 ab + bb: its rounding, ~1e-7 of aa, is far below every bound)."""
    import torch

    a, b = ref.float(), eff.float()
    if a.dim() != 2:
        a, b = a.reshape(1, -1), b.reshape(1, -1)
    rr, ee, re = (torch.einsum("ij,ij->j", x, y) for x, y in ((a, a), (b, b), (a, b)))
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


def column_spread(rr, ee, re) -> float:
    """Robust spread of log(re_j / ee_j) over the columns with real weight (rr, ee, re: per-column sums)."""
    import torch

    keep = (rr > 1e-6 * float(rr.median())) & (ee > 0) & (re > 0)
    if int(keep.sum()) < 2:
        return 0.0
    logc = torch.log(re[keep] / ee[keep])
    return float(1.4826 * (logc - logc.median()).abs().median())
