"""The audit of checkpoints made by other tools (quantlab.formats: compressed-tensors, GPTQ / AWQ, GGUF), with the
discipline of the ModelOpt audit: what is declared against what is stored, every scale finite and positive, every
quantized layer read by its format's QLAYERS class (dtypes, shapes, packing) and, with a reference, its dequantized
weight against the reference weight within its format's bounds, every reference tensor accounted for, and the logits
canary through the engine. Where a format stores things its own way its checks are registered in AUDITS.

    compressed-tensors  weight_scale / input_scale / k_scale / v_scale values (as for ModelOpt exports), the KV cache
                        scheme against <attention>.k_scale / v_scale, act-order refused at open
    gptq                scales finite and positive; symmetric declarations against the zero points (a v1 / v2
                        convention mix-up or swapped zero points move every code); desc_act against g_idx
    gguf                every block's scale finite (and non-negative for the types whose scale is), zero scales;
                        the file type against the tensor types; the vocabulary against the reference's, token by
                        token; the quantized token embedding against the reference's

Bounds: each layer class's `audit_bounds` (quantlab.engines.foreign), the same tables as quantlab's precisions."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quantlab.audit import metadata, scales, weights
from quantlab.audit.bounds import GAIN_CAP, SQNR_CAP, weight_bounds
from quantlab.audit.layout import Layout, _layout
from quantlab.audit.report import ERROR, INFO, WARNING, _natural, module_class
from quantlab.audit.state import AuditState
from quantlab.checkpoint import FLOAT_DTYPES, QUANTIZED_DTYPES
from quantlab.formats.base import Opened
from quantlab.registry import Registry

MARKERS = ("weight_packed", "qweight")  # tensors that say a layer is stored quantized (besides quantized .weight)
FORMAT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "input_scale",
                   "input_zero_point", "k_scale", "v_scale", "qweight", "qzeros", "scales", "g_idx")


def open_foreign(path: Path) -> Opened | None:
    """The checkpoint opened by its format when it is another tool's (None for a ModelOpt export); an unknown layout
    is a QuantlabError naming what was found."""
    from quantlab.formats import detect

    entry = detect(path)
    return None if entry.name == "modelopt" else entry.open(path)


class ForeignAuditState(AuditState):
    """An AuditState over another tool's checkpoint: the model built from its config (or GGUF metadata), a layer
    stored quantized when it holds its format's codes."""

    def __init__(self, opened: Opened, ref, device, dtype):
        from quantlab.engines import foreign  # noqa: F401 - registers the formats' layer classes in QLAYERS

        self.opened = opened
        super().__init__(opened.path, opened.quant, opened.config, opened.tensors, ref, device, dtype)

    def _layout_of(self, ckpt: Path) -> Layout:
        """Built from the format's config (a GGUF file's metadata when there is no config.json)."""
        return _layout(ckpt, self.opened.transformers_config())

    def _stored_state(self, module: str) -> str:
        if any(f"{module}.{m}" in self.t for m in MARKERS):
            return "quantized"
        dtype = self.t.dtype_of(f"{module}.weight")
        if dtype is None:
            return "missing"
        return "quantized" if dtype in QUANTIZED_DTYPES else "float"


@dataclass(frozen=True)
class FormatAudit:
    """A format's own checks: `declarations` (metadata: what the config says against the tensors) and `values`
    (scales: the format's scale tensors or blocks)."""

    declarations: Callable[[ForeignAuditState], None]
    values: Callable[[ForeignAuditState], None]


AUDITS: Registry[FormatAudit] = Registry("format audit", "a checkpoint format")


def steps() -> list[tuple[str, Callable]]:
    """The audit's checks for another tool's checkpoint, in the order of the ModelOpt audit (the canary is added by
    quantlab.audit.checks)."""
    return [("metadata", check_metadata), ("coverage", check_coverage), ("scales", check_values),
            ("kv_cache", check_kv_cache), ("format_weights", check_weights), ("tensors", check_tensors)]


# ---------------------------------------------------------------------------------------------- metadata
def check_metadata(a: ForeignAuditState) -> None:
    """What the checkpoint is (info), its declarations against its tensors, and with a reference its config and
    tokenizer against the reference's."""
    o = a.opened
    a.add(INFO, "metadata", [], f"{o.format} checkpoint ({o.tool}): {o.scheme}"
          + (f"; read but not applied: {'; '.join(o.notes)}" if o.notes else ""))
    AUDITS[o.format].declarations(a)
    if a.ref is None:
        a.skipped.append("metadata against the reference (no --reference): model config, tokenizer, chat "
                         "template and generation config not compared")
        return
    if o.format == "gguf":
        _gguf_against_reference(a)
        return
    from quantlab.audit import tokenizer as tokenizer_checks

    metadata._compare_config(a)
    tokenizer_checks.check_tokenizer(a)
    metadata._compare_generation_config(a)


# ---------------------------------------------------------------------------------------------- coverage
def check_coverage(a: ForeignAuditState) -> None:
    """Per Linear, the format's declaration against what is stored; an output head quantized (a warning where the
    tool's recipes keep it in high precision); an info line per module class."""
    lay, what = a.layout, f"the {a.opened.format} declaration"
    plain = [m for m in lay.linears if a.declared[m] is not None and a.stored[m] == "float"]
    stray = [m for m in lay.linears if a.declared[m] is None and a.stored[m] == "quantized"]
    if plain:
        a.add(ERROR, "coverage", plain, f"{len(plain)} module(s) that {what} quantizes are stored unquantized",
              "the tool skipped them (a module its recipe's targets missed at quantization time) or the weights "
              "were replaced after saving: loaders expect codes and scales there")
    if stray:
        a.add(ERROR, "coverage", stray, f"{len(stray)} module(s) are stored quantized although {what} leaves "
              "them unquantized (ignore list, lm_head flag, modules_to_not_convert)",
              "the config was edited or belongs to another checkpoint: loaders that honour it read the codes as "
              "plain weights, or refuse the file")
    head = [m for m in lay.linears if m == lay.head and a.stored[m] == "quantized"]
    if head:
        severity = INFO if a.opened.format == "gguf" else WARNING  # llama.cpp's mixes quantize the output head
        a.add(severity, "coverage", head, "the output head is quantized",
              "llama.cpp quantizes output.weight in its mixes (often Q6_K)" if severity == INFO else
              "the tool's recipes normally keep lm_head in high precision: check the quality cost")
    per_class: dict[str, list] = {}
    for module in lay.linears:
        fmt = a.declared[module]
        label = fmt.quant_algo if fmt is not None and a.stored[module] == "quantized" else "high precision"
        per_class.setdefault(module_class(module), []).append(label)
    parts = [f"{cls} " + ", ".join(f"{labels.count(x)}/{len(labels)} {x}" for x in sorted(set(labels)))
             for cls, labels in per_class.items()]
    a.add(INFO, "coverage", [], "quantized per module class: " + "; ".join(parts))


# ---------------------------------------------------------------------------------------------- scales, KV cache
def check_values(a: ForeignAuditState) -> None:
    """The format's scale tensors (or scale fields of its blocks)."""
    AUDITS[a.opened.format].values(a)


def check_kv_cache(a: ForeignAuditState) -> None:
    """KV cache scales on every attention module when the format declares a quantized KV cache, none otherwise,
    and not all exactly 1.0."""
    k_name, v_name = a.opened.kv_names
    present = [n for n in a.t.names() if n.endswith((f".{k_name}", f".{v_name}"))]
    if not a.quant.kv_cache_quant_algo:
        if present:
            a.add(ERROR, "kv_cache", sorted({n.rpartition(".")[0] for n in present}),
                  f"{len(present)} KV cache scale tensors, but the {a.opened.format} config declares no KV cache "
                  "quantization", "kv_cache_scheme was lost from the config: engines run an unquantized cache")
        return
    missing = [m for m in a.layout.attention if f"{m}.{k_name}" not in a.t or f"{m}.{v_name}" not in a.t]
    if missing:
        a.add(ERROR, "kv_cache", missing, f"the config declares a {a.quant.kv_cache_quant_algo} KV cache but "
              f"{len(missing)} of {len(a.layout.attention)} attention module(s) have no {k_name} / {v_name}",
              "the KV scales of these layers were never calibrated or not saved")
    values = [float(a.t.get(n).float().reshape(-1)[0]) for n in present if a.t.shape_of(n) in ((), (1,))]
    if len(values) > 1 and all(v == 1.0 for v in values):
        a.add(ERROR, "kv_cache", [], f"all {len(values)} KV cache scales are exactly 1.0",
              "a default, not a calibration result: K/V above 448 saturate")


def _ct_declarations(a: ForeignAuditState) -> None:
    """compressed-tensors: the declaration is read group by group when the checkpoint opens (unsupported schemes and
    act-order are refused there); layers whose tensors do not match their group's format are reported by the
    format check."""


def _ct_values(a: ForeignAuditState) -> None:
    scales.check_scales(a)  # weight_scale, input_scale, k_scale, v_scale: the ModelOpt audit's rules


def _gptq_declarations(a: ForeignAuditState) -> None:
    """GPTQ / AWQ: sym declared -> every zero point mid-range; desc_act false -> g_idx the plain column // group."""
    import torch

    from quantlab.formats.packing import AWQ_ORDER, unpack

    bad_zero, reordered = [], []
    for module in a.quantized_modules():
        fmt = a.declared[module]
        qz = a.t.optional(f"{module}.qzeros")
        if fmt.symmetric and qz is not None and qz.dtype == torch.int32:
            awq = fmt.quant_algo.startswith("AWQ")
            zeros = unpack(qz, fmt.bits, 1, AWQ_ORDER if awq else None) + fmt.zero_offset
            if bool((zeros != (1 << (fmt.bits - 1))).any()):
                bad_zero.append(module)
        g_idx = a.t.optional(f"{module}.g_idx")
        if g_idx is not None and not (a.opened.quant.raw or {}).get("desc_act") and fmt.group_size:
            plain = torch.arange(g_idx.numel()) // fmt.group_size
            if not torch.equal(g_idx.long(), plain):
                reordered.append(module)
    if bad_zero:
        mid = 1 << (a.quant.format_of(bad_zero[0]).bits - 1)
        a.add(ERROR, "format", bad_zero, f"{len(bad_zero)} layer(s) are declared symmetric (sym=true) but hold "
              f"zero points other than {mid} (after the format's offset)",
              "zero points swapped or damaged, or a v1 / v2 mix-up (checkpoint_format gptq stores z - 1, gptq_v2 "
              "stores z): every code of those layers dequantizes shifted by a step")
    if reordered:
        a.add(ERROR, "format", reordered, f"{len(reordered)} layer(s) have an act-order g_idx although the "
              "config says desc_act=false", "kernels that trust desc_act=false ignore g_idx and dequantize "
              "every column with the wrong group's scale")


def _gptq_values(a: ForeignAuditState) -> None:
    """scales tensors finite and positive (a GPTQ / AWQ scale is amax / qmax)."""
    import torch

    bad: dict[str, list] = {}
    for module in a.quantized_modules():
        s = a.t.optional(f"{module}.scales")
        if s is None:
            continue
        s = s.float()
        if not bool(torch.isfinite(s).all()):
            bad.setdefault("non-finite", []).append(module)
        elif bool((s < 0).any()):
            bad.setdefault("negative", []).append(module)
        elif bool((s == 0).any()):
            bad.setdefault("zero", []).append(module)
    for kind, modules in bad.items():
        a.add(ERROR, "scales", modules, f"{len(modules)} layer(s) have {kind} values in their scales tensor",
              "the tool wrote scales of an empty or broken calibration, or the file was damaged: every weight "
              "of those groups dequantizes to 0 / NaN / the wrong sign")


# ---------------------------------------------------------------------------------------------- GGUF
NONNEGATIVE_D = ("Q8_0", "Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K")  # ggml writes d = amax / qmax (or a range) here
ZERO_SHARE_ERROR = 0.01
LLAMA_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
                    11: "Q3_K", 12: "Q3_K", 13: "Q3_K", 14: "Q4_K", 15: "Q4_K", 16: "Q5_K", 17: "Q5_K", 18: "Q6_K",
                    32: "BF16"}


def _gguf_declarations(a: ForeignAuditState) -> None:
    """general.file_type against the tensor types: its main type must be among them."""
    from quantlab.formats.gguf import metadata as gguf_metadata

    meta = gguf_metadata(a.opened)
    file_type = meta.get("general.file_type")
    main = LLAMA_FILE_TYPES.get(file_type) if isinstance(file_type, int) else None
    types = {f.ggml_type for f in (a.declared[m] for m in a.layout.linears) if f is not None}
    if main and types and main not in types and main not in ("F32", "F16", "BF16"):
        a.add(WARNING, "metadata", [], f"general.file_type={file_type} says {main}, the quantized layers are "
              f"{', '.join(sorted(types))}", "the file was re-quantized or edited without updating its file type: "
              "tools that list files by it mislabel this one")


def _gguf_values(a: ForeignAuditState) -> None:
    """Every block's super-scale d: finite; non-negative where ggml writes it so; zero in more than 1% of a layer's
    blocks is an error (those blocks dequantize to zeros), in fewer a warning."""
    import torch

    from quantlab.formats import ggml

    found: dict[str, list] = {}
    for module in a.quantized_modules():
        kind = a.declared[module].ggml_type
        d = ggml.block_scales(a.t.get(f"{module}.weight"), kind)
        if not bool(torch.isfinite(d).all()):
            found.setdefault("nonfinite", []).append(module)
        elif kind in NONNEGATIVE_D and bool((d < 0).any()):
            found.setdefault("negative", []).append(module)
        zeros = float((d == 0).float().mean())
        if zeros > ZERO_SHARE_ERROR:
            found.setdefault("zero", []).append(module)
        elif zeros > 0:
            found.setdefault("some_zero", []).append(module)
    texts = {"nonfinite": (ERROR, "block scales hold NaN or Inf", "the file was damaged or written from NaN weights"),
             "negative": (ERROR, "negative block scales in a type whose scale ggml writes non-negative",
                          "the file was damaged (or written by a buggy quantizer)"),
             "zero": (ERROR, f"more than {ZERO_SHARE_ERROR:.0%} of the blocks have scale 0",
                      "zeroed or damaged scales: those blocks dequantize to zeros"),
             "some_zero": (WARNING, "some blocks have scale 0", "all-zero weight blocks (pruned weights) keep "
                           "scale 0; anything else dequantizes to zeros")}
    for kind, modules in found.items():
        severity, what, cause = texts[kind]
        a.add(severity, "scales", modules, f"{len(modules)} layer(s): {what}", cause)


def _gguf_against_reference(a: ForeignAuditState) -> None:
    """The model config the metadata gives and the vocabulary, token by token, against the reference's."""
    from quantlab.formats.gguf import PAIRING_KNOBS, special_token_mismatch, token_mismatch
    from quantlab.models import load_tokenizer

    knobs = PAIRING_KNOBS + ("max_position_embeddings", "tie_word_embeddings", "head_dim")
    changed = [k for k in knobs if k in a.ref.config and a.config.get(k) != a.ref.config[k]]
    theta = (a.ref.config.get("rope_parameters") or {}).get("rope_theta", a.ref.config.get("rope_theta"))
    if theta is not None and abs(a.config["rope_parameters"]["rope_theta"] - float(theta)) > 1e-6 * float(theta):
        changed.append("rope_theta")
    if changed:
        a.add(ERROR, "metadata", [], "the GGUF metadata describes another model than the reference: "
              + ", ".join(f"{k}: {a.ref.config.get(k)} -> {a.config.get(k)}" for k in changed[:6]),
              "the file was converted from another model or its metadata edited")
    tokenizer = load_tokenizer(a.ref)
    why = token_mismatch(a.opened, tokenizer)
    if why:
        a.add(ERROR, "metadata", [], f"the GGUF vocabulary differs from the reference tokenizer's: {why}",
              "the file was converted from another model or tokenizer version: the reference's token ids mean "
              "other tokens to it")
    special = special_token_mismatch(a.opened, tokenizer)
    if special:
        a.add(WARNING, "metadata", [], f"the GGUF special tokens differ from the reference tokenizer's: {special}",
              "the converter took BOS / EOS from another config (generation_config.json, chat template): "
              "llama.cpp would stop generating on another token; scores on the same ids are unaffected")


# ---------------------------------------------------------------------------------------------- weights, tensors
def check_weights(a: ForeignAuditState) -> None:
    """Every quantized layer read by its format's class against the reference (quantlab.audit.weights), then the
    quantized tensors that are not Linear weights (GGUF's token embedding)."""
    weights.check_layers(a)
    if a.ref_index is None or not a.opened.dequantized:
        return
    bad = []
    for name, kind in a.opened.dequantized.items():
        ref = a.ref_tensor(name)
        if ref is None:
            continue
        ours = a.t.get(name).float()
        if ours.shape != ref.shape:
            bad.append((name, f"shape {list(ours.shape)}, the reference {list(ref.shape)}"))
            continue
        row = _stats64(ref, ours)
        a.layers.append({"module": name.removesuffix(".weight"), "format": f"GGUF_{kind}", **row, "fold": None})
        b = weight_bounds(f"GGUF_{kind}")
        if row["cosine"] < b.cosine_error or row["sqnr_db"] < b.sqnr_error_db:
            bad.append((name, f"cosine {row['cosine']:.4f} SQNR {row['sqnr_db']:.1f} dB ({kind})"))
    if bad:
        a.add(ERROR, "weights", [n.rpartition(".")[0] for n, _ in bad], "quantized non-Linear tensor(s) do not "
              f"match the reference: {'; '.join(f'{n}: {w}' for n, w in bad)}",
              "the embedding was quantized from another model, or its blocks are damaged")


def _stats64(ref, ours) -> dict:
    """weight_stats.weight_stats in float64: a token embedding has tens of millions of values, where float32 dot
    products lose whole percents (a bit-exact Q8_0 embedding of 28M values read cosine 0.94)."""
    import torch

    a, b = ref.reshape(-1).double(), ours.reshape(-1).double()
    d = a - b
    aa, bb, ab, dd = (float(torch.dot(x, y)) for x, y in ((a, a), (b, b), (a, b), (d, d)))
    cosine = ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 else 0.0
    sqnr = 10 * math.log10(aa / dd) if dd > 0 and aa > 0 else (SQNR_CAP if aa > 0 else -SQNR_CAP)
    gain = ab / bb if bb > 0 else GAIN_CAP
    if not all(math.isfinite(x) for x in (cosine, sqnr, gain)):
        cosine, sqnr, gain = 0.0, -SQNR_CAP, GAIN_CAP
    return {"cosine": round(min(cosine, 1.0), 6), "sqnr_db": round(max(-SQNR_CAP, min(sqnr, SQNR_CAP)), 3),
            "gain": round(max(-GAIN_CAP, min(gain, GAIN_CAP)), 5)}


def check_tensors(a: ForeignAuditState) -> None:
    """Every reference tensor (or every tensor config.json implies) in the checkpoint, a quantized layer's weight
    standing for its format's tensors; unquantized tensors unchanged in shape and value (norms a smoothing fold
    explains: info); no unexplained extra tensors."""
    import torch

    source = ({n: tuple(h["shape"]) for n, h in a.ref_headers.items()} if a.ref_headers is not None
              else a.layout.expected)
    where = "the reference" if a.ref_headers is not None else "config.json's model"
    quantized = {m for m, s in a.stored.items() if s == "quantized"}
    stands_for = {f"{m}.weight" for m in quantized} | set(a.opened.dequantized)
    missing = [n for n in source if n not in a.t and n not in stands_for]
    if missing:
        a.add(ERROR, "tensors", sorted({n.rpartition(".")[0] for n in missing}, key=_natural),
              f"{len(missing)} tensor(s) of {where} missing from the checkpoint (e.g. {', '.join(missing[:3])})",
              "the tool skipped or renamed them (an untied output head dropped as a tied copy, a module it did not "
              "recognise): loaders initialise them randomly or refuse the file")
    owners = set(a.layout.linears) | set(a.layout.attention)
    unexpected = [n for n in a.t.names() if n not in source and not (
        n.rpartition(".")[2] in FORMAT_SUFFIXES and n.rpartition(".")[0] in owners)]
    if unexpected:
        a.add(WARNING, "tensors", sorted({n.rpartition(".")[0] for n in unexpected}, key=_natural),
              f"{len(unexpected)} tensor(s) in the checkpoint that {where} does not have (e.g. "
              f"{', '.join(unexpected[:3])})", "tensors of another model or a renamed module: loaders ignore them")
    if a.ref_index is None:
        return
    reshaped, changed, changed_1d, folded = [], [], [], []
    for name in source:
        if name not in a.t or name in stands_for or a.t.dtype_of(name) not in FLOAT_DTYPES:
            continue
        ours, ref = a.t.get(name), a.ref_tensor(name)
        if tuple(ours.shape) != source[name]:
            reshaped.append(name)
        elif not torch.equal(ref.to(ours.dtype), ours):
            rel = float((ref.float() - ours.float()).norm() / ref.float().norm().clamp_min(1e-30))
            (folded if name in a.folded else changed_1d if ours.dim() == 1 else changed).append((name, rel))
    if reshaped:
        a.add(ERROR, "tensors", [n.rpartition(".")[0] for n in reshaped], f"{len(reshaped)} unquantized tensor(s) "
              f"changed shape (e.g. {reshaped[0]})", "the checkpoint was made from another model or config")
    if changed:
        a.add(ERROR, "tensors", [n.rpartition(".")[0] for n, _ in changed], f"{len(changed)} unquantized "
              "tensor(s) differ from the reference: " + ", ".join(f"{n} (relative change {r:.3g})"
                                                                    for n, r in changed[:3]),
              "the tool wrote other values for weights it should keep, or the checkpoint is another model's")
    if changed_1d:
        a.add(WARNING, "tensors", [n.rpartition(".")[0] for n, _ in changed_1d], f"{len(changed_1d)} unquantized "
              "1-D tensor(s) (norms, biases) differ from the reference and no quantized layer's scales explain it: "
              + ", ".join(f"{n} (relative change {r:.3g})" for n, r in changed_1d[:3]),
              "a smoothing scale folded into a norm without the matching change in its consumers, or a norm "
              "taken from another layer")
    if folded:
        a.add(INFO, "tensors", [n.rpartition(".")[0] for n, _ in folded], f"{len(folded)} norm(s) differ from the "
              "reference because the tool folded smoothing scales into them (SmoothQuant / AWQ): their "
              "consumers' dequantized weights match the reference through them")


AUDITS.add("compressed-tensors", FormatAudit(_ct_declarations, _ct_values))
AUDITS.add("gptq", FormatAudit(_gptq_declarations, _gptq_values))
AUDITS.add("gguf", FormatAudit(_gguf_declarations, _gguf_values))
