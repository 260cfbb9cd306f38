"""tensors: every reference tensor (or every tensor config.json implies) is in the export, none dropped by a
tied-weight dedupe; unquantized tensors keep their shapes, values and dtypes (a cast to another dtype than the
reference's: what it cost in value and what an engine loads); no unexplained extra tensors."""
from __future__ import annotations

from quantlab.audit.report import ERROR, INFO, WARNING, _natural, abbreviate
from quantlab.audit.state import KV_SUFFIXES, SCALE_SUFFIXES, AuditState
from quantlab.checkpoint import FLOAT_DTYPES

DTYPE_NAMES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
DECLARED = {"float64": "F64", "double": "F64", "float32": "F32", "float": "F32", "bfloat16": "BF16",
            "float16": "F16", "half": "F16"}
# a cast's relative change beyond any rounding of values in the dtype's normal range (bfloat16's half ulp is at
# most 2^-8 = 0.0039, float16's 2^-11): values under its range flushed to zero or subnormals
OUT_OF_RANGE = 1e-2


def check_tensors(a: AuditState) -> None:
    """Every reference tensor (or every tensor config.json implies) in the export, none dropped or unexplained,
    unquantized ones unchanged in shape, value and dtype."""
    source = ({n: tuple(h["shape"]) for n, h in a.ref_headers.items()} if a.ref_headers is not None
              else a.layout.expected)
    where = "the reference" if a.ref_headers is not None else "config.json's model"
    quantized = set(a.quantized_modules()) | {m for m, s in a.stored.items() if s == "quantized"}
    missing = [n for n in source if n not in a.t]
    head_weight = f"{a.layout.head}.weight" if a.layout.head else None
    dropped = [n for n in missing if n == head_weight or n.rpartition(".")[0] in a.layout.embeddings]
    others = [n for n in missing if n not in dropped]
    if dropped:
        untied = a.ref is not None and not a.ref.config.get("tie_word_embeddings", False)
        a.add(ERROR, "tensors", [n.rpartition(".")[0] for n in dropped], f"{', '.join(dropped)} "
              f"of {where} {'is' if len(dropped) == 1 else 'are'} missing from the export"
              + (" (the reference does not tie the output head to the input embedding)" if untied else ""),
              "a tied-weight dedupe treated an untied output head and input embedding as one tensor and dropped "
              "one: loaders initialise it randomly or tie it silently",
              consequence=("vLLM / SGLang stop on the missing weight, or (in loaders that tie by default) run the "
                           "embedding as the output head: logits of another model"),
              fix=("re-export with the tied-weight dedupe fixed: an untied head and embedding are two tensors and "
                   "both must be written"))
    if others:
        a.add(ERROR, "tensors", sorted({n.rpartition(".")[0] for n in others}, key=_natural),
              f"{len(others)} tensor(s) of {where} missing from the export (e.g. {', '.join(others[:3])})",
              "export skipped them: modules it did not recognise (MoE experts in a layout it could not "
              "iterate, renamed by a conversion mapping) or a dedupe of weights it took for copies",
              consequence=("vLLM / SGLang / TensorRT-LLM stop on the missing weights, or leave them at their initial"
                           " values where a loader does not check"),
              fix=("re-export so that every tensor of the model is written (check module renames and MoE expert "
                   "layouts)"))
    known = set(source)
    owners = set(a.layout.linears) | set(a.layout.attention)
    unexpected = [n for n in a.t.names() if n not in known and not (
        n.rpartition(".")[2] in SCALE_SUFFIXES + KV_SUFFIXES
        and (n.rpartition(".")[0] in owners or n.rpartition(".")[0].rpartition(".")[0] in owners))]
    if unexpected:
        a.add(WARNING, "tensors", sorted({n.rpartition(".")[0] for n in unexpected}, key=_natural),
              f"{len(unexpected)} tensor(s) in the export that {where} does not have (e.g. "
              f"{', '.join(unexpected[:3])})", "tensors of another model or a renamed module: loaders report "
              "them as unexpected and ignore them",
              consequence=("vLLM raises on weights the model does not have, transformers warns and ignores them: "
                           "either the load fails or the tensors are silently dropped"),
              fix="remove the stray tensors, or audit against the model they belong to")
    if a.ref_index is not None:
        _values(a, source, quantized)


def _values(a: AuditState, source: dict[str, tuple], quantized: set[str]) -> None:
    """The reference's unquantized float tensors against the export's: shape, value (up to the stored dtype) and
    dtype."""
    import torch

    reshaped, changed, changed_1d, refolded = [], [], [], []
    kept: dict[str, str] = {}  # unquantized float tensor -> its stored dtype
    drifted: list[dict] = []  # those stored in another dtype than the reference's
    for name in source:
        if name not in a.t or a.t.dtype_of(name) not in FLOAT_DTYPES or (
                name.endswith(".weight") and name.rpartition(".")[0] in quantized):
            continue
        ours = a.t.get(name)
        if tuple(ours.shape) != source[name]:
            reshaped.append(f"{name} {list(ours.shape)} (reference {list(source[name])})")
            continue
        ref = a.ref_tensor(name)
        ref_dtype = a.ref_headers[name]["dtype"]
        if ref_dtype in FLOAT_DTYPES:
            kept[name] = a.t.dtype_of(name)
            if kept[name] != ref_dtype:
                drifted.append(_cast(name, ref, ours, ref_dtype, kept[name]))
        if torch.equal(ref.to(ours.dtype), ours):
            continue
        if name in a.folded:
            refolded.append(name)
            continue
        x, y = ref.float().reshape(-1), ours.float().reshape(-1)
        rel = float((x - y).norm() / x.norm().clamp_min(1e-30))
        (changed_1d if ours.dim() == 1 else changed).append((name, rel))
    if reshaped:
        a.add(ERROR, "tensors", [r.split(" ")[0].rpartition(".")[0] for r in reshaped],
              f"{len(reshaped)} unquantized tensor(s) changed shape: {'; '.join(reshaped[:3])}",
              "the export was made from another model or config",
              consequence="engines fail at load on the shapes",
              fix="re-export from the intended model and config")
    if changed:
        a.add(ERROR, "tensors", [n.rpartition(".")[0] for n, _ in changed], f"{len(changed)} unquantized "
              "tensor(s) differ from the reference: " + ", ".join(f"{n} (relative change {r:.3g})"
                                                                    for n, r in changed[:3]),
                 "the export wrote other values for weights it should keep (a tied copy of the other weight, a "
                 "smoothing scale folded into a weight with no quantized consumer, another model's tensors)",
              consequence=("every engine runs these values, not the reference's: the served model differs from the "
                           "one calibrated"),
              fix="re-export; copy the reference's values back for tensors that export must keep")
    if changed_1d:
        a.add(WARNING, "tensors", [n.rpartition(".")[0] for n, _ in changed_1d], f"{len(changed_1d)} "
              "unquantized 1-D tensor(s) (norms, biases) differ from the reference and no quantized layer's "
              "scales explain it: " + ", ".join(f"{n} (relative change {r:.3g})" for n, r in changed_1d[:3]),
              "a pre_quant_scale folded into a norm without the matching change in its consumers, or a norm "
              "taken from another layer",
              consequence=("every engine runs the changed norms / biases: their consumers see inputs scaled other "
                           "than they were calibrated for"),
              fix="re-export (the fold of smoothing scales must change the norm and its consumers together)")
    if refolded:
        a.add(INFO, "tensors", [n.rpartition(".")[0] for n in refolded], f"{len(refolded)} norm(s) differ from "
              "the reference because export folded AWQ pre_quant_scales into them (their consumers' "
              "dequantized weights match the reference through them)")
    if drifted:
        _dtype_drift(a, kept, drifted)


def _cast(name: str, ref, ours, ref_dtype: str, dtype: str) -> dict:
    """What storing the reference's tensor in `dtype` does to its values: the relative change of the finite values
    (the reference cast, so a fold or an edit on top does not count), values the reference had finite and the
    stored tensor has not (overflow: float16 past 65504), and whether the cast kept every value (an upcast)."""
    import torch

    wide = torch.promote_types(ref.dtype, torch.float32)
    x, y = ref.to(wide), ref.to(ours.dtype).to(wide)
    finite = x.isfinite()
    both = finite & y.isfinite()
    if not bool(both.all()):
        x, y = x[both], y[both]
    rel = float((x - y).norm() / x.norm().clamp_min(1e-30)) if x.numel() else 0.0
    lost = int((finite & ~ours.isfinite()).sum())
    lossless = lost == 0 and bool(torch.equal(x, y)) and bool((both | ~finite).all())
    return {"name": name, "ref": ref_dtype, "ours": dtype, "rel": rel, "nonfinite": lost, "lossless": lossless,
            "max": float(ref[finite].abs().max()) if lost else 0.0}


def _listed(group: list[dict]) -> str:
    """`n tensor(s) stored as D where the reference has R (names; relative change up to r)` per dtype pair."""
    pairs: dict[tuple, list[dict]] = {}
    for d in group:
        pairs.setdefault((d["ours"], d["ref"]), []).append(d)
    return "; ".join(f"{len(ds)} stored as {DTYPE_NAMES[ours]} where the reference has {DTYPE_NAMES[ref]} "
                     f"({abbreviate([d['name'] for d in ds], 3)}; relative change "
                     f"{'0' if all(d['lossless'] for d in ds) else format(max(d['rel'] for d in ds), '.3g')})"
                     for (ours, ref), ds in pairs.items())


def _dtype_drift(a: AuditState, kept: dict[str, str], drifted: list[dict]) -> None:
    """Unquantized tensors stored in another dtype than the reference's, by what an engine then serves. Values the
    cast made inf / NaN or flushed away (beyond any rounding): error. Values rounded to a dtype config.json does
    not declare (the embedding alone in bfloat16 in a float32 export; every tensor in bfloat16 under a float32
    declaration): warning, the engines that serve the declared dtype run rounded values the reference did not
    have. Values rounded to the declared dtype (a bfloat16 export of a float32 model, which engines serve in
    bfloat16 anyway), and casts that keep every value (an upcast): info."""
    declared_name = a.config.get("dtype") or a.config.get("torch_dtype")
    declared = DECLARED.get(str(declared_name).removeprefix("torch.")) if declared_name else None
    said = f"config.json declares {declared_name}" if declared_name else "config.json declares no dtype"
    tied = {f"{e}.weight" for e in a.layout.embeddings} if a.layout.tie_word_embeddings else set()
    lowered = ", which vLLM and SGLang lower to bfloat16 / float16" if declared in (None, "F32") else ""
    engines = ("vLLM, SGLang, TensorRT-LLM and transformers load each tensor in its stored dtype and cast it to the "
               f"serving dtype (--dtype; under auto config.json's, {declared_name or 'here none: float32'}{lowered})")
    broken = [d for d in drifted if d["nonfinite"] or d["rel"] > OUT_OF_RANGE]
    lossless = [d for d in drifted if d["lossless"]]
    rounded = [d for d in drifted if d not in broken and d not in lossless]
    undeclared = [d for d in rounded if d["ours"] != declared]
    as_declared = [d for d in rounded if d["ours"] == declared]
    if broken:
        over = [d for d in broken if d["nonfinite"]]
        a.add(ERROR, "tensors", [d["name"].rpartition(".")[0] for d in broken], f"{len(broken)} unquantized "
              f"tensor(s) lost values to a cast to another dtype than the reference's: {_listed(broken)}"
              + (f"; {sum(d['nonfinite'] for d in over)} finite value(s) of the reference stored as inf / NaN "
                 f"(largest |value| {max(d['max'] for d in over):.4g}; float16's largest is 65504)" if over else
                 f"; a change beyond rounding ({OUT_OF_RANGE:g}): values under the stored dtype's range flushed "
                 "to zero or subnormals"),
              "the export cast the model (or these tensors) to a dtype whose range does not hold the reference's "
              "values (float16 for a model trained in bfloat16 / float32)",
              consequence=engines + ": they load the inf / NaN / flushed values as stored, in any serving dtype; "
              "an inf in an embedding, norm or head turns every logit it reaches into NaN",
              fix="re-export in the reference's dtype (model.dtype="
                  f"{DTYPE_NAMES[broken[0]['ref']]}) or in bfloat16, which has float32's range")
    if undeclared:
        ref_dtype = undeclared[0]["ref"]
        others = [n for n, dt in kept.items() if dt == ref_dtype]
        why = (f", while {len(others)} other unquantized tensor(s) keep the reference's {DTYPE_NAMES[ref_dtype]}"
               if others else " (all of the export's unquantized tensors)" if len(undeclared) == len(kept) else "")
        heads = [d["name"] for d in undeclared if d["name"] in tied]
        rest = ", the others the reference's" if others else ""
        a.add(WARNING, "tensors", [d["name"].rpartition(".")[0] for d in undeclared], f"{len(undeclared)} "
              f"unquantized tensor(s) stored rounded to another dtype than the reference's and than the one "
              f"{said}{why}: {_listed(undeclared)}"
              + (f"; config.json ties the output head to {', '.join(heads)}: engines that tie compute the logits "
                 "with the rounded table" if heads else ""),
              "a cast of some tensors only (a save that converted the embedding table, a dtype= applied to part of "
              "the model, a tool that writes tables in bfloat16), or of the whole model without updating "
              "config.json's dtype",
              consequence=engines + ": served in a wider dtype than the stored one (transformers or TensorRT-LLM "
              "under a float32 config, any engine given --dtype float32), these tensors run the stored dtype's "
              f"rounded values (no cast brings the reference's mantissa bits back){rest}: not the model "
              "calibrated and compared with the reference; served in the stored dtype, they run what the "
              "reference cast at load would give",
              fix=f"re-export with every unquantized tensor in the reference's dtype ({DTYPE_NAMES[ref_dtype]}), "
                  "or cast the whole model and declare that dtype in config.json")
    if as_declared:
        a.add(INFO, "tensors", [d["name"].rpartition(".")[0] for d in as_declared], f"{len(as_declared)} "
              f"unquantized tensor(s) stored rounded to {DTYPE_NAMES[declared]}, the dtype config.json declares: "
              f"{_listed(as_declared)} (engines serve that dtype under dtype=auto: they load the values they "
              "would have cast the reference's to)")
    if lossless:
        a.add(INFO, "tensors", [d["name"].rpartition(".")[0] for d in lossless], f"{len(lossless)} unquantized "
              f"tensor(s) stored in another dtype than the reference's without losing a value: {_listed(lossless)}")
