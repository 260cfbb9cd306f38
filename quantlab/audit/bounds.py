"""The bounds the audit holds each format to, read from the precision registry (every precision states its own:
quantlab.precisions.AuditBounds; every KV cache format its ScaleBounds), and the figures that are format-independent
(gain, report caps)."""
from __future__ import annotations

from quantlab.precisions import KV_FORMATS, CanaryBounds, ScaleBounds, WeightBounds, precision_by_algo

# formats quantlab has no precision for (a checkpoint made elsewhere): loose, so only gross damage is an error
DEFAULT_WEIGHT_BOUNDS = WeightBounds(cosine_error=0.9, sqnr_error_db=6.0, sqnr_warn_db=9.0)
DEFAULT_CANARY_BOUNDS = CanaryBounds(top1_error=0.5, top1_warn=0.65, kl_error=1.0, kl_warn=0.5)
GAIN_ERROR = 0.15  # |gain - 1| over this: the scales are off by a constant factor (halved scales: gain 2)
GAIN_WARN = 0.05
SQNR_CAP, GAIN_CAP = 999.0, 1e6  # report figures stay finite (strict JSON): an exact match reads 999 dB


def _layer_bounds(algo: str):
    """The bounds another tool's format states on its QLAYERS class (quantlab.engines.foreign), or None."""
    from quantlab.engines.qlayers import QLAYERS

    return getattr(QLAYERS[algo], "audit_bounds", None) if algo in QLAYERS else None


def weight_bounds(algo: str) -> WeightBounds:
    """The per-layer bounds of a format: its precision's, another tool's format's own, or a loose default."""
    precision = precision_by_algo(algo)
    if precision is not None and precision.audit:
        return precision.audit.weights
    layer = _layer_bounds(algo)
    return layer.weights if layer is not None else DEFAULT_WEIGHT_BOUNDS


def canary_bounds(algos: set[str]) -> CanaryBounds:
    """The loosest bounds among the formats present (a mixed export is judged by its most aggressive format)."""
    found = []
    for algo in algos:
        precision, layer = precision_by_algo(algo), _layer_bounds(algo)
        found.append(precision.audit.canary if precision is not None and precision.audit else
                     layer.canary if layer is not None else DEFAULT_CANARY_BOUNDS)
    found = found or [DEFAULT_CANARY_BOUNDS]
    return CanaryBounds(min(b.top1_error for b in found), min(b.top1_warn for b in found),
                        max(b.kl_error for b in found), max(b.kl_warn for b in found))


def activation_bounds(algo: str) -> ScaleBounds | None:
    """The activation-scale bounds of a format (None: no static activation scale, or a format quantlab does not
    make: its scales are checked for sanity only)."""
    precision = precision_by_algo(algo)
    return precision.audit.activations if precision is not None and precision.audit else None


def kv_bounds(kv_algo: str | None) -> ScaleBounds | None:
    """The k_scale / v_scale bounds of a KV cache format (its registry entry's), None when it has none."""
    entry = KV_FORMATS.find(lambda f: f.quant_algo is not None and f.quant_algo == kv_algo)
    return entry.audit if entry is not None else None
