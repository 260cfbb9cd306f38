"""activations: static activation and KV-cache scales against the activations they quantize.

With the reference (the probe forward, quantlab.audit.probe): every quantized Linear with a static input scale has
its input, as the export's GEMM would see it (times its pre_quant_scale, or the scale folded into the norm that
feeds it), quantized the way its format does it with the stored input_scale, on held-out text. Its statistic is the
SQNR lost against the best static scale for that text (max |x| / qmax): near 0 dB when the scale fits the
activations (FP8's relative precision does not care about a scale a little large; a few clipped outliers cost a
fraction of a dB), many dB when the format clips the outliers (a scale too small: one layer calibrated on too few
tokens, a unit error) or spends its range on nothing (a scale too large: amax written without dividing by qmax, INT8
on a few levels, FP8 in its subnormals). With an FP8 KV cache, K (after RoPE) and V likewise with k_scale / v_scale.
The ratio max |x| / (scale x qmax) goes with each row: a unit factor in it names the mistake. Bounds: each format's
ScaleBounds (quantlab.precisions), measured on healthy exports (bench/audit_healthy.py).

Without the reference: the Linears that share one input (q/k/v, gate/up) carry one input scale (ModelOpt's export
unifies them; engines fuse them with one scale).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from quantlab.audit.bounds import activation_bounds, kv_bounds
from quantlab.audit.coverage import FUSED_SIBLINGS
from quantlab.audit.report import ERROR, WARNING, abbreviate
from quantlab.audit.state import AuditState

# unit mistakes a ratio can reveal: scales written in another format's units, or amax written for amax / qmax
UNIT_FACTORS = {1 / 448: "x448 (amax written without dividing by E4M3's 448)",
                448.0: "/448 (divided by 448 twice)",
                1 / 127: "x127 (amax written without dividing by INT8's 127)",
                127.0: "/127 (divided by 127 twice)",
                448 / 127: "127/448 (an FP8 scale, amax / 448, where INT8's amax / 127 belongs)",
                127 / 448: "448/127 (an INT8 scale, amax / 127, where FP8's amax / 448 belongs)",
                1 / 6: "x6 (an NVFP4 global scale written without E2M1's 6)"}
CLIP = ("engines (vLLM, SGLang, TensorRT-LLM, quantlab's engine) quantize these inputs with the stored static scale: "
        "every value above scale x qmax saturates, on every token that has one; the clipped values are the outliers "
        "that carry most of the signal")
WASTE = ("engines quantize these inputs with the stored static scale: the activations use a sliver of the format's "
         "range (INT8: a few levels; FP8: values fall into the subnormals or to zero), so the layer computes mostly "
         "rounding noise")
FIX = ("recalibrate the activation scales (more, or more representative, calibration text) and re-export; if the "
       "ratio is a unit factor, fix the tool that wrote the scale: input_scale = amax / qmax of the input as the GEMM "
       "sees it (after pre_quant_scale)")
FP8_MAX = 448.0


@dataclass(frozen=True)
class Static:
    """A static quantization of an input: its format, the stored scale, the format's qmax, its pre_quant_scale."""

    algo: str
    scale: float
    qmax: float
    pre_quant_scale: object = None  # FloatTensor [in] or None

    def qdq(self, x, scale: float):
        """x quantized and dequantized the way the format does it with this scale (x float32; a new tensor)."""
        import torch

        if self.algo == "W8A8_SQ_PER_CHANNEL":
            return (x / scale).round_().clamp_(-128, 127).mul_(scale)
        if self.algo == "NVFP4":
            from quantlab.engines.qlayers import nvfp4_qdq

            return nvfp4_qdq(x, torch.tensor(scale, dtype=torch.float32, device=x.device))
        return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().mul_(scale)


class Tally:
    """Sums over the probe's calls of one input: signal, error with the stored scale, error with the best static
    scale for the text (its own max |x| / qmax, where the stored one clips), and max |x|."""

    def __init__(self, spec: Static, smoothing: str | None):
        self.spec, self.smoothing = spec, smoothing
        self.signal = self.error = self.ideal = self.amax = 0.0

    def add(self, x, smoothing) -> None:
        """One call's input (smoothing: the per-input-channel scale the GEMM's input is multiplied by, or None)."""
        x = x.detach().float().reshape(-1, x.shape[-1])
        if smoothing is not None and smoothing.shape[-1] == x.shape[-1]:
            x = x * smoothing.to(x.device)
        flat = x.reshape(-1)
        amax = float(flat.abs().max()) if flat.numel() else 0.0
        self.amax = max(self.amax, amax)
        self.signal += float(flat @ flat)
        stored = _squared_error(flat, self.spec.qdq(x, self.spec.scale).reshape(-1))
        self.error += stored
        # the best static scale for this text: max |x| / qmax where the stored one clips; where it covers max |x|
        # there is nothing to gain from clipping less (its wasted range is judged by the ratio), so it counts as is
        clips = amax > self.spec.scale * self.spec.qmax
        self.ideal += _squared_error(flat, self.spec.qdq(x, amax / self.spec.qmax).reshape(-1)) if clips else stored

    def merge(self, other: Tally) -> None:
        """Take another tally's sums (the same input, the same quantization: q/k/v of one layer)."""
        self.signal, self.error, self.ideal, self.amax = other.signal, other.error, other.ideal, other.amax

    def row(self) -> dict:
        """The tally's figures: SQNR with the stored scale and with the best one (dB), their difference, the ratio
        of max |x| to what the stored scale reaches."""
        reach = self.spec.scale * self.spec.qmax
        sqnr, best = _db(self.signal, self.error), _db(self.signal, self.ideal)
        return {"format": self.spec.algo, "observed": round(self.amax, 6), "reach": _finite(reach),
                "ratio": _finite(self.amax / reach) if reach > 0 else None, "sqnr_db": sqnr, "best_sqnr_db": best,
                "loss_db": round(best - sqnr, 3) if sqnr is not None and best is not None else None,
                "smoothing": self.smoothing}


def _squared_error(x, q) -> float:
    q.sub_(x)
    return float(q @ q)


def _db(signal: float, error: float) -> float | None:
    if signal <= 0 or not math.isfinite(signal) or not math.isfinite(error):
        return None
    return round(10 * math.log10(signal / error), 3) if error > 0 else 999.0


def _finite(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None


def _scalar(a: AuditState, name: str) -> float | None:
    """A per-tensor scale's value, None when absent, not scalar, not finite or not positive (scales reports it)."""
    if name not in a.t or a.t.shape_of(name) not in ((), (1,)):
        return None
    value = float(a.t.get(name).float().reshape(-1)[0])
    return value if math.isfinite(value) and value > 0 else None


def input_specs(a: AuditState) -> dict[str, Static]:
    """The static input quantization of every quantized Linear that has one (what the probe measures)."""
    specs = {}
    for module in a.quantized_modules():
        algo = a.declared[module].quant_algo
        bounds = activation_bounds(algo)
        scale = _scalar(a, f"{module}.input_scale")
        if bounds is None or scale is None:
            continue
        pqs = a.t.get(f"{module}.pre_quant_scale").float() if f"{module}.pre_quant_scale" in a.t else None
        specs[module] = Static(algo, scale, bounds.qmax, pqs)
    return specs


def kv_specs(a: AuditState) -> dict[str, tuple]:
    """attention module -> (K, V) static quantization of an FP8 KV cache (None where a scale is missing)."""
    bounds = kv_bounds(a.quant.kv_cache_quant_algo)
    if bounds is None:
        return {}
    out = {}
    for attention in a.layout.attention:
        k, v = _scalar(a, f"{attention}.k_proj.k_scale"), _scalar(a, f"{attention}.v_proj.v_scale")
        if k is not None or v is not None:
            out[attention] = tuple(None if s is None else Static(a.quant.kv_cache_quant_algo, s, bounds.qmax)
                                   for s in (k, v))
    return out


def check_activations(a: AuditState) -> None:
    """Activation and KV scales against the reference's activations (with the probe), shared-input scales."""
    _shared_input_scales(a)
    if a.probe is None:
        a.skipped.append("activations: input / KV scales against the activations they quantize (needs --reference)")
        return
    specs = input_specs(a)
    rows = [{"module": m, "kind": "input", **a.probe.inputs[m]} for m in specs if m in a.probe.inputs]
    rows += [{"module": n, "kind": n.rpartition(".")[2][0], **r} for n, r in sorted(a.probe.kv.items())]
    a.activations = rows
    unobserved = [m for m in specs if m not in a.probe.inputs]
    if unobserved:
        a.skipped.append(f"activations: {len(unobserved)} layer(s) the reference forward does not run as separate "
                         f"Linears ({abbreviate(unobserved, 3)}): their input scales were checked for sanity only")
    _judge(a, [r for r in rows if r["kind"] == "input"], "input")
    _judge(a, [r for r in rows if r["kind"] in ("k", "v")], "kv")
    _judge_median(a, rows)


def _judge(a: AuditState, rows: list[dict], what: str) -> None:
    """An error / warning per direction (clipping: ratio > 1; wasted range: ratio < 1) for the rows that lose more
    SQNR than their bounds allow."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        b = kv_bounds(a.quant.kv_cache_quant_algo) if what == "kv" else activation_bounds(row["format"])
        loss = math.inf if row["loss_db"] is None else row["loss_db"]
        ratio = math.inf if row["ratio"] is None else row["ratio"]
        if ratio >= 1 or loss > b.clip_error_db:  # clipping (or a loss no range can explain)
            severity, direction = (ERROR if loss > b.clip_error_db and ratio > b.clip_ratio_error
                                   else WARNING if loss > b.clip_warn_db else None), "clip"
        else:
            severity, direction = (ERROR if ratio < b.waste_ratio_error else WARNING if ratio < b.waste_ratio_warn
                                   else None), "waste"
        if severity:
            groups.setdefault((severity, direction), []).append(row)
    scale = "k_scale / v_scale" if what == "kv" else "input_scale"
    for (severity, direction), found in groups.items():
        found.sort(key=lambda r: -(r["loss_db"] if r["loss_db"] is not None else math.inf))
        b = kv_bounds(a.quant.kv_cache_quant_algo) if what == "kv" else activation_bounds(found[0]["format"])
        shown = "; ".join(_describe(r) for r in found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3
                                                               else "")
        if direction == "clip":
            bound = b.clip_error_db if severity == ERROR else b.clip_warn_db
            reach = f" and the text reaches over {b.clip_ratio_error:g}x past the scale" if severity == ERROR else ""
            message = (f"{len(found)} {scale}(s) cover too little of the activations they quantize: quantizing the "
                       f"reference's activations on held-out text with them loses more than {bound:g} dB of SQNR "
                       f"against the best static scale{reach} ({shown})")
        else:
            bound = b.waste_ratio_error if severity == ERROR else b.waste_ratio_warn
            message = (f"{len(found)} {scale}(s) are far larger than the activations they quantize: the "
                       f"reference's max |x| on held-out text reaches less than {bound:.3g} of scale x qmax "
                       f"({shown})")
        cause = ("the scale is too small: calibrated on too few or unrepresentative tokens, divided by a unit twice, "
                 "or taken from another layer or format" if direction == "clip" else
                 "the scale is too large: amax written without dividing by qmax, another format's units, or a scale "
                 "of another layer")
        unit = _unit(found)
        if unit:
            cause = f"the ratio max |x| / (scale x qmax) matches a unit factor, {unit}; " + cause
        a.add(severity, "kv_cache" if what == "kv" else "activations", [r["module"] for r in found], message, cause,
              consequence=CLIP if direction == "clip" else WASTE, fix=FIX)


def _judge_median(a: AuditState, rows: list[dict]) -> None:
    """An error when the median layer of a format (or the KV cache) loses more than its bound: a mistake every
    layer shares, which a single layer's bound may be too loose to call."""
    import statistics

    by: dict[str, list[dict]] = {}
    for row in rows:
        by.setdefault("KV cache" if row["kind"] in ("k", "v") else row["format"], []).append(row)
    for fmt, found in by.items():
        b = kv_bounds(a.quant.kv_cache_quant_algo) if fmt == "KV cache" else activation_bounds(fmt)
        median = statistics.median(math.inf if r["loss_db"] is None else r["loss_db"] for r in found)
        if median <= b.clip_median_error_db:
            continue
        unit = _unit(found)
        a.add(ERROR, "kv_cache" if fmt == "KV cache" else "activations", [r["module"] for r in found],
              f"the median of {len(found)} {fmt} {'K / V' if fmt == 'KV cache' else 'input'} scale(s) loses "
              f"{median:.1f} dB of SQNR on held-out text against the best static scale (healthy exports: at most "
              f"{b.clip_median_error_db:g} dB; worst: {_describe(max(found, key=lambda r: r['loss_db'] or math.inf))})",
              (f"the ratio max |x| / (scale x qmax) matches a unit factor, {unit}; " if unit else "") +
              "a mistake every layer shares: scales written in another format's units, divided twice, or a "
              "calibration that saw nothing like real text",
              consequence=CLIP, fix=FIX)


def _describe(row: dict) -> str:
    ratio = "inf" if row["ratio"] is None else f"{row['ratio']:.3g}"
    loss = "all" if row["loss_db"] is None else f"{row['loss_db']:.1f} dB"
    smooth = f", after {row['smoothing']}" if row.get("smoothing") else ""
    return f"{row['module']}{' ' + row['kind'].upper() if row['kind'] != 'input' else ''}: {loss} lost, max |x| " \
           f"{ratio}x the scale's reach{smooth}"


def _unit(rows: list[dict]) -> str | None:
    """A unit factor all the rows' ratios sit near (within a factor 1.5), if any: the likely mistake."""
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    for factor, text in UNIT_FACTORS.items():
        if ratios and all(abs(math.log(r / factor)) < math.log(1.5) for r in ratios):
            return text
    return None


def _shared_input_scales(a: AuditState) -> None:
    """Linears that read one input (the probe's relation when it ran, else q/k/v, gate/up, w1/w3 by name) with
    different input scales."""
    groups: dict[str, list[str]] = {}
    for module in a.quantized_modules():
        if _scalar(a, f"{module}.input_scale") is None:
            continue
        if a.probe is not None and module in a.probe.seen:
            key = a.probe.shared.get(module, module)
        else:
            parent, _, leaf = module.rpartition(".")
            names = next((n for n in FUSED_SIBLINGS if leaf in n), None)
            key = f"{parent}.{'/'.join(names)}" if names else module
        groups.setdefault(key, []).append(module)
    bad = []
    for members in groups.values():
        values = {m: _scalar(a, f"{m}.input_scale") for m in members}
        lo, hi = min(values.values()), max(values.values())
        if len(members) > 1 and hi / lo > 1 + 1e-6:
            bad.append((members, values, hi / lo))
    if bad:
        bad.sort(key=lambda b: -b[2])
        members, values, spread = bad[0]
        a.add(WARNING, "activations", [m for g in bad for m in g[0]], f"{len(bad)} group(s) of layers that read one "
              f"input carry different input scales (largest spread x{spread:.3g}: "
              + ", ".join(f"{m} {v:.4g}" for m, v in values.items()) + ")",
              "one member's scale was recalibrated, edited or taken from another layer (ModelOpt's export unifies "
              "them to the largest)",
              consequence="vLLM and TensorRT-LLM fuse these layers into one GEMM with one input scale (the "
              "largest); engines that run them apart clip the members with the smaller scale",
              fix="give the group one input scale (the largest), or recalibrate and re-export")
