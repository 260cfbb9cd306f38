"""scales: every scale tensor finite, positive and not underflowed; kv_cache: k_scale / v_scale for every attention
module when the KV cache is declared FP8 (none otherwise), and not all exactly 1.0."""
from __future__ import annotations

from quantlab.audit.report import ERROR, WARNING, _natural
from quantlab.audit.state import SCALE_SUFFIXES, AuditState
from quantlab.checkpoint import FLOAT_DTYPES

F32_TINY = 1.1754944e-38  # smallest normal float32: below it a scale is flushed to zero by FTZ kernels
FP8_TINY = 2.0 ** -6  # smallest normal E4M3


def check_scales(a: AuditState) -> None:
    """Every scale tensor finite, positive and not underflowed (zero, float32 subnormal, FP8 block scales of 0 or mostly
    subnormal)."""
    import torch

    kinds: dict[str, list[str]] = {}
    worst: dict[str, str] = {}
    for name in a.t.names():
        suffix = name.rpartition(".")[2]
        if suffix not in SCALE_SUFFIXES:
            continue
        dtype = a.t.dtype_of(name)
        v = a.t.get(name).float()
        finite = torch.isfinite(v)
        problems = []
        if not bool(finite.all()):
            problems.append(("nonfinite", f"{name}: {int((~finite).sum())} NaN/Inf of {v.numel()}"))
        if bool((v[finite] < 0).any()):
            problems.append(("negative", f"{name}: {int((v < 0).sum())} negative, "
                                          f"min {float(v[finite].min()):.3g}"))
        zeros = int((v == 0).sum())
        if zeros:
            kind = "fp8_zero" if dtype.startswith("F8") else "zero"
            problems.append((kind, f"{name}: {zeros} of {v.numel()} are 0"))
        if dtype in FLOAT_DTYPES and bool(((v > 0) & (v < F32_TINY)).any()):
            problems.append(("subnormal", f"{name}: {float(v[v > 0].min()):.3g}"))
        if dtype.startswith("F8"):
            tiny = int(((v > 0) & (v < FP8_TINY)).sum())
            if tiny > max(1, v.numel() // 100):
                problems.append(("fp8_subnormal", f"{name}: {tiny} of {v.numel()} below 2^-6"))
        for kind, text in problems:
            kinds.setdefault(kind, []).append(name)
            worst.setdefault(kind, text)
    texts = {
        "nonfinite": (ERROR, "scale tensor(s) hold NaN or Inf",
                      "calibration saw NaN/Inf (an overflowing fp16 forward, a NaN weight) or divided by an amax "
                      "of 0: every output through these layers is NaN"),
        "negative": (ERROR, "scale tensor(s) hold negative values",
                     "a scale is amax / qmax and cannot be negative: the tensor was written from the wrong buffer "
                     "or damaged"),
        "zero": (ERROR, "scale tensor(s) are 0",
                 "amax was 0: a layer that saw no calibration data (an MoE expert routed no tokens), or a scale "
                 "that underflowed when cast to a narrower type: dequantization gives 0, division gives Inf"),
        "fp8_zero": (ERROR, "FP8 block scale(s) underflowed to 0",
                     "per-block scales far below the tensor's largest block round to 0 in E4M3 (the per-block "
                     "scale underflow bug): those blocks dequantize to zeros; exporters must clamp them to 2^-9"),
        "subnormal": (ERROR, "scale tensor(s) are float32 subnormals (< 1.2e-38)",
                      "a scale this small is flushed to zero by FTZ kernels; it comes from an amax of ~0 or a "
                      "unit error (amax divided twice)"),
        "fp8_subnormal": (WARNING, "FP8 block scales: more than 1% are E4M3 subnormals (< 2^-6)",
                          "blocks much smaller than the tensor's largest are stored with fewer than 3 mantissa "
                          "bits: the per-tensor scale (weight_scale_2) is dominated by outliers"),
    }
    for kind, names in kinds.items():
        severity, what, cause = texts[kind]
        modules = sorted({n.rpartition(".")[0] for n in names}, key=_natural)
        a.add(severity, "scales", modules, f"{len(names)} {what} (e.g. {worst[kind]})", cause,
              consequence=("engines multiply by these scales at every step: NaN / Inf propagate to every output, "
                           "zeros silence the layer, negative scales flip signs, underflowed scales are flushed to "
                           "zero by FTZ kernels"),
              fix="recalibrate the affected layers (their quantizers saw no data, or overflowed) and re-export")


def check_kv_cache(a: AuditState) -> None:
    """k_scale / v_scale on every attention module when the KV cache is declared FP8 (none otherwise), and not all
    exactly 1.0."""
    present = [n for n in a.t.names() if n.rpartition(".")[2] in ("k_scale", "v_scale")]
    if not a.quant.kv_cache_quant_algo:
        if present:
            a.add(ERROR, "kv_cache", sorted({n.rpartition(".")[0] for n in present}),
                  f"{len(present)} k_scale / v_scale tensors, but hf_quant_config.json declares no KV cache "
                  "quantization", "kv_cache_quant_algo was lost from the config (edited, or written by another "
                  "tool): engines run an unquantized cache, not the one calibrated",
                  consequence=("engines reading hf_quant_config.json run an unquantized (16-bit) KV cache and ignore"
                               " the scales: not the cache that was calibrated and evaluated, and twice its memory"),
                  fix=("set kv_cache_quant_algo (and config.json's kv_cache_scheme) to the format the scales belong "
                       "to, or re-export without KV quantization"))
        return
    missing = [m for m in a.layout.attention
               if f"{m}.k_proj.k_scale" not in a.t or f"{m}.v_proj.v_scale" not in a.t]
    if missing:
        a.add(ERROR, "kv_cache", missing, f"kv_cache_quant_algo={a.quant.kv_cache_quant_algo} but "
              f"{len(missing)} of {len(a.layout.attention)} attention module(s) have no k_scale / v_scale "
              f"(expected at <attention>.k_proj.k_scale and <attention>.v_proj.v_scale)",
              "the KV quantizers of these layers were disabled or never calibrated, or export did not write "
              "them: engines fall back to scale 1.0 or refuse the checkpoint",
              consequence=("vLLM uses a scale of 1.0 for attention layers without k_scale / v_scale (K/V above 448 "
                           "saturate); TensorRT-LLM refuses the checkpoint"),
              fix=("re-export with every attention module's KV quantizers calibrated (the recipe's *k_bmm_quantizer "
                   "/ *v_bmm_quantizer entries must match them)"))
    if not present:
        return
    values = {n: float(a.t.get(n).float().reshape(-1)[0]) for n in present if a.t.shape_of(n) in ((), (1,))}
    ones = [n for n, v in values.items() if v == 1.0]
    if ones and len(ones) == len(values) and len(values) > 1:
        a.add(ERROR, "kv_cache", sorted({n.rpartition(".")[0] for n in ones}),
              f"all {len(values)} KV cache scales are exactly 1.0",
              "a default, not a calibration result: the KV quantizers were never calibrated (the recipe's "
              "KV entries did not match the attention modules), or the exporter clamped every scale to >= 1.0; "
              "K/V above 448 saturate and the cache is not the one evaluated",
              consequence=("engines run an FP8 cache with scale 1.0: K/V above 448 saturate and small values lose "
                           "precision; not the cache that was calibrated"),
              fix=("calibrate the KV quantizers (check that the recipe's KV entries match the attention modules) and"
                   " re-export"))
    elif ones:
        a.add(WARNING, "kv_cache", sorted({n.rpartition(".")[0] for n in ones}),
              f"{len(ones)} of {len(values)} KV cache scales are exactly 1.0",
              "these layers' KV quantizers were probably not calibrated (scale left at its default)",
              consequence="those layers' KV cache runs at scale 1.0 in every engine",
              fix="calibrate the KV quantizers of these layers and re-export")
