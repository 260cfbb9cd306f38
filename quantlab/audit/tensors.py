"""tensors: every reference tensor (or every tensor config.json implies) is in the export, none dropped by a
tied-weight dedupe; unquantized tensors keep their shapes and values; no unexplained extra tensors."""
from __future__ import annotations

from quantlab.audit.report import ERROR, INFO, WARNING, _natural
from quantlab.audit.state import KV_SUFFIXES, SCALE_SUFFIXES, AuditState
from quantlab.checkpoint import FLOAT_DTYPES


def check_tensors(a: AuditState) -> None:
    """Every reference tensor (or every tensor config.json implies) in the export, none dropped or unexplained,
    unquantized ones unchanged in shape and value."""
    import torch

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
    if a.ref_index is None:
        return
    reshaped, changed, changed_1d, refolded = [], [], [], []
    for name in source:
        if name not in a.t or a.t.dtype_of(name) not in FLOAT_DTYPES or (
                name.endswith(".weight") and name.rpartition(".")[0] in quantized):
            continue
        ours = a.t.get(name)
        if tuple(ours.shape) != source[name]:
            reshaped.append(f"{name} {list(ours.shape)} (reference {list(source[name])})")
            continue
        ref = a.ref_tensor(name)
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
