"""format and weights: every quantized layer built by the QLAYERS class of its declared format (a wrong dtype, shape
or missing tensor named), and, with a reference, its dequantized weight against the reference weight (cosine, SQNR,
gain) within the bounds its precision states."""
from __future__ import annotations

import re

from quantlab.audit import equivalence
from quantlab.audit.bounds import GAIN_ERROR, GAIN_WARN, weight_bounds
from quantlab.audit.coverage import check_fused_groups
from quantlab.audit.layout import _Probe, block_of
from quantlab.audit.report import ERROR, INFO, WARNING
from quantlab.audit.state import SCALE_SUFFIXES, AuditState
from quantlab.audit.weight_stats import as_good_as_format, format_baseline
from quantlab.audit.weight_stats import weight_stats as _weight_stats
from quantlab.checkpoint import FLOAT_DTYPES, CheckpointTensors, LayerFormat
from quantlab.errors import QuantlabError

_MISSING_CAUSE = {
    "input_scale": "its input (activation) quantizer was never calibrated (an MoE expert that received no calibration "
                   "tokens, a layer the forward loop never reached): static activation quantization has no scale",
    "weight_scale": "export wrote codes without their scales (a quantizer without amax)",
    "weight_scale_2": "the per-tensor second-level scale was not written: the block scales cannot be dequantized",
    "pre_quant_scale": "the smoothing scale was neither written nor folded into a norm",
}


def check_layers(a: AuditState) -> None:
    """Build every quantized layer with the QLAYERS class of its declared format ("format"), then compare its
    dequantized weight with the reference ("weights")."""
    import torch

    from quantlab.engines.qlayers import QLAYERS, LayerContext

    ctx = LayerContext("cpu", False, torch.float32)  # built as on disk (no kernel layouts), compared on the device:
    dev = a.device.torch if getattr(a.device, "type", "cpu") == "cuda" else "cpu"  # one layer at a time on a GPU
    refusals: dict[tuple, list] = {}
    unknown: dict[str, list] = {}
    stats: list[dict] = []
    pairs = equivalence.PairAnalysis(a) if a.ref_index is not None else None
    held: dict[str, tuple] = {}  # this block's layers the smoothing-pair analysis needs (quantlab.audit.equivalence)
    rows: dict[str, dict] = {}
    for module in a.quantized_modules():
        if pairs is not None and held and block_of(module) != block_of(next(iter(held))):
            pairs.block(held, rows)
            held = {}
        fmt: LayerFormat = a.declared[module]
        if fmt.quant_algo not in QLAYERS:
            unknown.setdefault(fmt.quant_algo, []).append(module)
            continue
        out_f, in_f, has_bias = a.layout.linears[module]
        probe = _Probe(a.t)
        try:
            layer = QLAYERS[fmt.quant_algo].from_checkpoint(module, out_f, in_f, has_bias, probe, fmt, ctx)
        except QuantlabError as exc:
            _refused(module, fmt, probe.refusal, exc, refusals)
            continue
        except (RuntimeError, ValueError, IndexError) as exc:  # tensors the format cannot even unpack
            _refused(module, fmt, None, QuantlabError(f"{type(exc).__name__}: {str(exc)[:160]}"), refusals)
            continue
        if a.ref_index is not None:
            keep = held if equivalence.wanted(module) else None
            row = _compare_weight(a, module, fmt, layer if dev == "cpu" else layer.to(dev), dev, keep)
            if row:
                stats.append(row)
                rows[module] = row
        del layer
    if pairs is not None:
        if held:
            pairs.block(held, rows)
        pairs.report()
    _report_refusals(a, refusals)
    for algo, modules in unknown.items():
        a.add(INFO, "format", modules, f"{len(modules)} layer(s) in format {algo}, which quantlab cannot "
              f"dequantize (it knows {', '.join(QLAYERS)}): their scales' shapes and weights were not audited")
    check_fused_groups(a)
    _check_smoothing_present(a)
    a.layers = stats
    if a.ref_index is None:
        a.skipped.append("weights: dequantized weights vs the reference (no --reference)")
        return
    _judge_weights(a, stats)


def _role(module: str) -> str:
    """A module's role: its name with every block index replaced by * (model.layers.*.self_attn.o_proj)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", module)


def _check_smoothing_present(a: AuditState) -> None:
    """A layer without the pre_quant_scale that the other layers of its role and format carry: a smoothing scale the
    weights need and the export lacks. Decided on the tensors present, not on how much error the missing scale
    makes (a scale near 1 on one machine's calibration hides in the weights' SQNR): ModelOpt writes a role's scales
    for all its layers or folds them for all (into the norm ahead, or into the producing linear layer)."""
    roles: dict[tuple, list[tuple[str, bool]]] = {}
    for module in a.quantized_modules():
        key = (_role(module), a.declared[module].quant_algo)
        roles.setdefault(key, []).append((module, a.t.dtype_of(f"{module}.pre_quant_scale") is not None))
    for (role, algo), members in sorted(roles.items()):
        lacking = [m for m, has in members if not has]
        if not lacking or len(lacking) == len(members):
            continue
        a.add(ERROR, "weights", lacking, f"{len(lacking)} of {len(members)} {algo} layer(s) of {role} have no "
              f"pre_quant_scale while the other {len(members) - len(lacking)} store one (e.g. {lacking[0]})",
              _MISSING_CAUSE["pre_quant_scale"] + " for these layers only (a writer that drops or skips some "
              "layers' scales, a loader-side rename that misses them)",
              consequence=("every engine runs these layers without their smoothing: each input channel is off by "
                           "its smoothing factor, however small the weight error looks"),
              fix="re-export so every layer of the role keeps its pre_quant_scale (or folds it where it can)")


def _refused(module: str, fmt: LayerFormat, refusal, exc: QuantlabError, out: dict) -> None:
    """Group a layer's refusal with others of the same kind: (check, kind, declared format, tensor suffix, what
    was found) -> [(module, one line about it)]."""
    algo, group = fmt.quant_algo, f" group_size {fmt.group_size}" if fmt.group_size else ""
    if refusal is None:  # refused on values (reported by the scales check) or on the group size
        if "non-positive or non-finite" not in exc.problem:
            out.setdefault(("format", "unreadable", f"{algo}{group}", "", ""), []).append((module, exc.problem))
        return
    kind, tensor, found, wanted = refusal
    suffix = tensor.rpartition(".")[2]
    check = "scales" if suffix in SCALE_SUFFIXES else "format"
    if kind == "missing":
        out.setdefault((check, "missing", algo, suffix, ""), []).append((module, tensor))
    elif kind == "dtype":
        out.setdefault(("format", "dtype", algo, suffix, found), []).append((module, f"{tensor} ({found}, "
                                                                                     f"{algo} stores {wanted})"))
    else:
        out.setdefault((check, "shape", f"{algo}{group}", suffix, ""), []).append(
            (module, f"{tensor} has shape {found}, {algo}{group} needs {wanted}"))


def _report_refusals(a: AuditState, refusals: dict) -> None:
    for (check, kind, algo, suffix, found), entries in refusals.items():
        modules, example, n = [m for m, _ in entries], entries[0][1], len(entries)
        if kind == "unreadable":
            a.add(ERROR, check, modules, f"{n} layer(s) cannot be read as {algo}: {example}",
                  "hf_quant_config.json does not match the tensors",
                  consequence=("engines build these layers from the declared format and fail on the tensors' shapes "
                               "or dtypes at load"),
                  fix="make hf_quant_config.json declare the format the tensors hold, or re-export")
        elif kind == "missing":
            a.add(ERROR, check, modules, f"{n} layer(s) declared {algo} have no {suffix} tensor (e.g. "
                  f"{example})", _MISSING_CAUSE.get(suffix, "export did not write it"),
                  consequence=("vLLM / TensorRT-LLM fail at load on the missing tensor, or run the layer with a "
                               "default (1.0) scale"),
                  fix="re-export with every quantizer of these layers calibrated")
        elif kind == "dtype":
            key = (algo, suffix, found)
            if key not in a._like:
                a._like[key] = _looks_like(a.t, modules[0], a.layout.linears[modules[0]],
                                              a.declared[modules[0]])
            like = f"; the tensors read as {a._like[key]}" if a._like[key] else ""
            a.add(ERROR, check, modules, f"{n} layer(s) declared {algo} store their {suffix} as {found} "
                  f"(e.g. {example}){like}",
                  "hf_quant_config.json declares another format than the one written (an edited config, a "
                  "config from another export, or a mixed-precision export whose per-layer list is wrong): "
                  "engines misread every such layer",
                  consequence=("engines misread every such layer (another format's codes decoded as this one's) or "
                               "refuse the checkpoint"),
                  fix=("make hf_quant_config.json declare the format the tensors hold (an edited or foreign config),"
                       " or re-export"))
        else:
            a.add(ERROR, check, modules, f"{n} layer(s): {suffix} shapes do not match {algo} (e.g. {example})",
                  "the group size in hf_quant_config.json is not the one the weights were quantized with, or "
                  "scales were transposed / concatenated wrongly (fused layers, sharded writers)",
                  consequence=("engines fail at load on the scale shapes, or (where shapes happen to fit) apply "
                               "scales to the wrong groups of weights"),
                  fix="declare the group size the weights were quantized with, or re-export")


def _compare_weight(a: AuditState, module: str, fmt: LayerFormat, layer, dev: str = "cpu",
                    keep: dict | None = None) -> dict | None:
    """The layer's stored weight against the reference in the space the quantizer worked in: a smoothed layer
    stores W / s (s its pre_quant_scale, or the scale export folded into the norm ahead of it), so the
    dequantized weight is compared with W_ref / s, where every output channel's error is the quantizer's own.
    keep (a dict): module -> (every candidate space [(fold, reference there)], dequantized weight), for the
    smoothing-pair analysis (quantlab.audit.equivalence)."""
    ref_w = a.ref_tensor(f"{module}.weight")
    if ref_w is None:
        return None
    ref_w = ref_w.to(dev).float()
    deq = layer.dequantized_weight().float()
    if deq.shape != ref_w.shape:
        a.add(ERROR, "weights", [module], f"dequantized weight has shape {list(deq.shape)}, the reference "
              f"{list(ref_w.shape)}", "the export was made from another model",
              consequence="engines fail at load on the shapes",
              fix="audit against the model the export was made from, or re-export from the intended model")
        return None
    pqs = getattr(layer, "pre_quant_scale", None)
    if pqs is not None:
        candidates = [("pre_quant_scale", pqs.float())]
    else:
        candidates = [(None, None), *((n, v.to(dev)) for n, v in _fold_candidates(a, module, deq.shape[1]))]
    best = None
    spaces = []
    for fold, scale in candidates:
        space = ref_w if scale is None else ref_w / scale[None, :]
        spaces.append((fold, space))
        row = _weight_stats(space, deq)
        if best is None or row["sqnr_db"] > best[1]["sqnr_db"]:
            best = (fold, row, space)
    fold, row, space = best
    if keep is not None:
        keep[module] = (spaces, deq)
    if fold and fold != "pre_quant_scale":
        a.folded.add(fold)
    b = weight_bounds(fmt.quant_algo)
    if row["cosine"] < b.cosine_error or row["sqnr_db"] < b.sqnr_error_db or row["column_spread"] > \
            b.column_spread_error:  # beyond the format's bounds: what does the format itself make of this layer?
        row["format_rtn"] = format_baseline(space, fmt.quant_algo, fmt.group_size)
    return {"module": module, "format": fmt.quant_algo, **row, "fold": fold}


def _fold_candidates(a: AuditState, module: str, width: int):
    """Per-input scales export may have folded into a norm ahead of this layer (AWQ layers sharing an input):
    exported / reference value of the changed 1-D tensor whose output IS this layer's input in the reference
    forward (the probe's relation), and (1+w) norms' (1+w') / (1+w). A layer the probe saw fed by no norm (o_proj,
    down_proj) has no candidate: a smoothing scale missing there is not explained away by a norm of its block.
    Layers the probe did not observe (experts fused in memory) fall back to every changed 1-D tensor of the
    block."""
    import torch

    block = block_of(module)
    if block not in a._vectors:
        a._vectors[block] = []
        for name in a.t.names():
            ref = a.ref_tensor(name) if block_of(name) == block else None
            if ref is None or ref.dim() != 1 or a.t.dtype_of(name) not in FLOAT_DTYPES:
                continue
            ours, ref = a.t.get(name).float(), ref.float()
            if ours.shape == ref.shape and not torch.equal(ours, ref):
                a._vectors[block].append((name, ours, ref))
    feeder = None
    if a.probe is not None and module in a.probe.seen:
        feeder = a.probe.feeds.get(module)
        if feeder is None:
            return
    for name, ours, ref in a._vectors[block]:
        if ours.shape[0] != width or (feeder is not None and name.rpartition(".")[0] != feeder):
            continue
        for new, old in ((ours, ref), (1 + ours, 1 + ref)):
            ratio = new / torch.where(old.abs() > 1e-12, old, torch.ones_like(old))
            yield name, torch.where((old.abs() > 1e-12) & (ratio.abs() > 1e-12), ratio, torch.ones_like(ratio))


def _judge_weights(a: AuditState, stats: list[dict]) -> None:
    direction, noise, noisy, gain_bad, gain_warn = [], [], [], [], []
    limited = [r for r in stats if as_good_as_format(r)]  # beyond the bounds only as far as the format itself goes
    _format_limited(a, limited)
    judged = [r for r in stats if not as_good_as_format(r)]
    _judge_columns(a, judged)
    for row in judged:
        b = weight_bounds(row["format"])
        if row["cosine"] < b.cosine_error:
            direction.append(row)
        elif row["sqnr_db"] < b.sqnr_error_db:
            noise.append(row)
        elif row["sqnr_db"] < b.sqnr_warn_db:
            noisy.append(row)
        if abs(row["gain"] - 1) > GAIN_ERROR:
            gain_bad.append(row)
        elif abs(row["gain"] - 1) > GAIN_WARN:
            gain_warn.append(row)

    def describe(rows: list[dict]) -> str:
        rows = sorted(rows, key=lambda r: r["sqnr_db"])
        shown = ", ".join(f"{r['module']} cosine {r['cosine']:.4f} SQNR {r['sqnr_db']:.1f} dB gain "
                          f"{r['gain']:.3f}" for r in rows[:3])
        return shown + (f" (and {len(rows) - 3} more)" if len(rows) > 3 else "")

    def bounds_text(rows: list[dict]) -> str:
        return "; ".join(f"{f}: error below cosine {weight_bounds(f).cosine_error} / "
                         f"{weight_bounds(f).sqnr_error_db} dB" for f in sorted({r["format"] for r in rows}))

    if direction:
        a.add(ERROR, "weights", [r["module"] for r in direction], f"{len(direction)} layer(s) dequantize to "
              f"weights pointing elsewhere than the reference's: {describe(direction)} "
              f"({bounds_text(direction)})",
              "codes and scales do not belong together: scales of another layer or block size, codes packed "
              "in another order, layers swapped or renamed, or weights quantized from another model; a "
              "low-memory export path that mis-scaled blocks gave cosine 0.756 with half-sized scales",
              consequence=("every engine runs these layers with weights that are not the model's: outputs far from "
                           "the reference"),
              fix=("re-export; if the fault persists, find the writer that mismatches codes and scales (layer names,"
                   " block order, packing)"))
    if noise:
        a.add(ERROR, "weights", [r["module"] for r in noise], f"{len(noise)} layer(s) dequantize with far "
              f"more error than the format allows: {describe(noise)} ({bounds_text(noise)})",
              "scales off by a factor (see gain), clipped or saturated codes, or an amax calibrated on the "
              "wrong tensor",
              consequence=("every engine runs these layers with far more weight error than the format has when "
                           "healthy"),
              fix="re-export with correct scales (see gain for a constant factor)")
    if noisy:
        a.add(WARNING, "weights", [r["module"] for r in noisy], f"{len(noisy)} layer(s) dequantize with more "
              f"error than healthy exports of their format: {describe(noisy)}",
              "outlier weights stretching the scales (check the layer), or an aggressive clipping search",
              consequence=("served as is, these layers carry more quantization error than healthy exports of the "
                           "format"),
              fix="check the layer's weights for outliers; try a finer format or keep the layer in high precision")
    if gain_bad:
        a.add(ERROR, "weights", [r["module"] for r in gain_bad], f"{len(gain_bad)} layer(s) are scaled by a "
              "constant factor against the reference (gain = the factor that maps them back; 1.0 when "
              f"healthy): {describe(gain_bad)}",
              "weight scales halved / doubled or a per-tensor scale (weight_scale_2, a global scale) applied "
              "twice or not at all, as in the low-memory NVFP4 export with half-sized scales",
              consequence=("every engine runs these layers scaled by the gain: activations grow or shrink layer "
                           "after layer"),
              fix="re-export with correct scales (a per-tensor or block scale applied twice, halved or missing)")
    elif gain_warn:
        a.add(WARNING, "weights", [r["module"] for r in gain_warn], f"{len(gain_warn)} layer(s) are scaled by "
              f"more than {GAIN_WARN:.0%} against the reference: {describe(gain_warn)}",
              "a clipping search shrank the scales, or a scale is slightly off",
              consequence="served as is, these layers are scaled slightly off the reference",
              fix="compare with another calibration; re-export if the scale is wrong")
    if stats:
        worst = min(stats, key=lambda r: r["sqnr_db"])
        a.add(INFO, "weights", [], f"{len(stats)} quantized layers compared with the reference: SQNR "
              f"{min(r['sqnr_db'] for r in stats):.1f}-{max(r['sqnr_db'] for r in stats):.1f} dB (worst "
              f"{worst['module']}), cosine >= {min(r['cosine'] for r in stats):.4f}, gain "
              f"{min(r['gain'] for r in stats):.3f}-{max(r['gain'] for r in stats):.3f}")


def _format_limited(a: AuditState, rows: list[dict]) -> None:
    """Layers beyond their format's general bounds that are as good as the format's own round-to-nearest of the
    same weights: a format too coarse for them (outlier-heavy layers), not a broken export."""
    if not rows:
        return
    rows = sorted(rows, key=lambda r: r["sqnr_db"])
    shown = ", ".join(f"{r['module']} SQNR {r['sqnr_db']:.1f} dB cosine {r['cosine']:.4f} spread "
                      f"{r['column_spread']:.3f} (round-to-nearest: {r['format_rtn']['sqnr_db']:.1f} dB, "
                      f"{r['format_rtn']['cosine']:.4f}, {r['format_rtn']['column_spread']:.3f})" for r in rows[:3])
    a.add(WARNING, "weights", [r["module"] for r in rows], f"{len(rows)} layer(s) carry more error than healthy "
          f"exports of their format, as much as the format's own round-to-nearest of the same (smoothed) weights "
          f"gives: {shown}{' (and more)' if len(rows) > 3 else ''}",
          "the format is too coarse for these layers (outlier-heavy weights): the export itself is consistent",
          consequence="served as is, these layers carry the format's full error; the evaluation measures its cost",
          fix="keep these layers in higher precision (quantization exclusions) or use a finer group size")


def _judge_columns(a: AuditState, stats: list[dict]) -> None:
    """Layers whose dequantized weight matches the reference only after a rescale per input channel."""
    for severity in (ERROR, WARNING):
        rows = [r for r in stats if (r["column_spread"] > weight_bounds(r["format"]).column_spread_error
                                     if severity == ERROR else
                                     weight_bounds(r["format"]).column_spread_warn < r["column_spread"]
                                     <= weight_bounds(r["format"]).column_spread_error)]
        if not rows:
            continue
        rows.sort(key=lambda r: -r["column_spread"])
        shown = ", ".join(f"{r['module']} {r['column_spread']:.3f} (smoothing: {r['fold'] or 'none'})"
                          for r in rows[:3])
        limit = (weight_bounds(rows[0]["format"]).column_spread_error if severity == ERROR
                 else weight_bounds(rows[0]["format"]).column_spread_warn)
        a.add(severity, "weights", [r["module"] for r in rows], f"{len(rows)} layer(s) match the reference only "
              f"after a different factor per input channel (robust spread of log factor over {limit:g}: {shown})",
              "a per-channel smoothing scale is missing or belongs to another layer: AWQ / SmoothQuant divided the "
              "weight's input channels by it, and neither a pre_quant_scale nor a norm that feeds this layer "
              "multiplies the input back",
              consequence="every engine runs these layers with each input channel off by its smoothing factor "
              "(vLLM's ModelOpt loaders also ignore a pre_quant_scale they do not expect)",
              fix="re-export so the layer keeps its pre_quant_scale, or fold it into the module that feeds it "
              "(the norm ahead of q/k/v and gate/up; v_proj / up_proj for o_proj / down_proj where shapes allow)")


def _looks_like(t: CheckpointTensors, module: str, dims: tuple, fmt: LayerFormat) -> str | None:
    """The first other registered format whose QLAYERS class reads this layer's tensors without refusal."""
    import torch

    from quantlab.engines.qlayers import QLAYERS, LayerContext

    out_f, in_f, has_bias = dims
    ctx = LayerContext("cpu", False, torch.float32)
    group = _group_guess(t, module, in_f)
    for algo in QLAYERS:
        if algo == fmt.quant_algo:
            continue
        try:
            QLAYERS[algo].from_checkpoint(module, out_f, in_f, has_bias, t, LayerFormat(algo, group), ctx)
        except (QuantlabError, RuntimeError, ValueError, ZeroDivisionError):
            continue
        return algo
    return None


def _group_guess(t: CheckpointTensors, module: str, in_features: int) -> int | None:
    shape = t.shape_of(f"{module}.weight_scale")
    return in_features // shape[1] if shape and len(shape) == 2 and shape[1] and in_features % shape[1] == 0 else None
