"""coverage: per Linear, the format hf_quant_config.json declares against what is stored; an output head, router or
vision module quantized at all; in mixed exports, layers that engines fuse sharing one format."""
from __future__ import annotations

import re

from quantlab.audit.report import ERROR, INFO, WARNING, _natural, module_class
from quantlab.audit.state import AuditState
from quantlab.checkpoint import LayerFormat

FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
HIGH_PRECISION_NAMES = ("lm_head", "embed_out", "output_layer", "gate", "router", "shared_expert_gate")  # last parts


def check_coverage(a: AuditState) -> None:
    """Per Linear, the declared format against what is stored: declared but plain, stored quantized but excluded, a head
    / router / vision module quantized; an info line per module class."""
    lay = a.layout
    plain_declared, identical, stray, policy = [], [], [], []
    for module in lay.linears:
        fmt, state = a.declared[module], a.stored[module]
        if fmt is not None and state == "float":
            plain_declared.append(module)
            ref_w = a.ref_tensor(f"{module}.weight")
            if ref_w is not None:
                ours = a.t.get(f"{module}.weight")
                if ours.shape == ref_w.shape and bool((ours.float() == ref_w.float()).all()):
                    identical.append(module)
        elif fmt is None and state == "quantized":
            stray.append(module)
        if fmt is not None and _kept_high_precision(module, lay.head):
            policy.append(module)
    if plain_declared:
        algos = sorted({a.declared[m].quant_algo for m in plain_declared})
        dtypes = sorted({a.t.dtype_of(f"{m}.weight") for m in plain_declared})
        same = (f"; {len(identical)} of them identical to the reference weights" if identical else "")
        placeholders = [m for m in plain_declared if f"{m}.weight_scale" in a.t]
        extra = f"; {len(placeholders)} carry scale tensors beside float weights" if placeholders else ""
        a.add(ERROR, "coverage", plain_declared, f"{len(plain_declared)} module(s) declared {', '.join(algos)} "
              f"by hf_quant_config.json are stored unquantized ({', '.join(dtypes)} weights){same}{extra}",
              "their quantizers were disabled or never calibrated (an MoE expert that received no calibration "
              "tokens, a module class the recipe's patterns missed), or export wrote the original weights: the "
              "output is not quantized although the checkpoint says it is",
              consequence=("vLLM, SGLang and TensorRT-LLM build these layers as the config declares: quantized "
                           "kernels over plain float weights and no scales (the load fails on the missing "
                           "weight_scale / dtype, or runs garbage); transformers-based tools run them unquantized: "
                           "what is served is not what was measured"),
              fix=("re-export so the declared layers carry their codes and scales, or list them in exclude_modules /"
                   " ignore if they are meant to stay in high precision"))
    if stray:
        a.add(ERROR, "coverage", stray, f"{len(stray)} module(s) are stored quantized "
              f"({', '.join(sorted({a.t.dtype_of(m + '.weight') for m in stray}))} codes) although "
              "hf_quant_config.json " + ("does not list them" if a.quant.mixed else "excludes them"),
              "a quantizer stayed enabled on a module the recipe keeps in high precision (output head, "
              "vision tower, router), or exclude_modules was edited: loaders that honour the config read the "
              "codes as plain weights",
              consequence=("engines that honour exclude_modules build a float layer and read the codes as values "
                           "(off by their scale: garbage outputs); engines that ignore the list quantize where the "
                           "checkpoint says not to"),
              fix=("re-export with the module excluded (its quantizer disabled), or remove it from exclude_modules "
                   "and ignore if it is meant to be quantized"))
    if policy:
        a.add(WARNING, "coverage", policy, f"{len(policy)} output head / router / vision module(s) are "
              "quantized", "ModelOpt's recipes keep these in high precision; a pattern such as *lm_head* did "
              "not match (renamed module), or a search chose it: check the quality cost",
              consequence=("vLLM's ModelOpt loader keeps output heads and routers in high precision: a quantized "
                           "head's codes and scales do not load into it (a load error or codes read as values); "
                           "where it runs, the head's error lands on every logit"),
              fix=("keep the head / router / vision modules out of quantization (ModelOpt's default patterns) and "
                   "re-export, unless a measured search chose them on purpose"))
    per_class: dict[str, list] = {}
    for module in lay.linears:
        fmt = a.declared[module]
        label = fmt.quant_algo if fmt is not None and a.stored[module] == "quantized" else "high precision"
        per_class.setdefault(module_class(module), []).append(label)
    parts = []
    for cls, labels in per_class.items():
        counts = {x: labels.count(x) for x in sorted(set(labels))}
        parts.append(f"{cls} " + ", ".join(f"{n}/{len(labels)} {x}" for x, n in counts.items()))
    a.add(INFO, "coverage", [], "quantized per module class: " + "; ".join(parts))


def check_fused_groups(a: AuditState) -> None:
    """Mixed precision: layers that engines fuse share format and group size: q/k/v, gate/up, w1/w3 of one
    parent, and each projection across the experts of one MoE layer (grouped expert kernels)."""
    if not a.quant.mixed:
        return
    groups: dict[tuple, list[str]] = {}
    for module in a.layout.linears:
        parent, _, leaf = module.rpartition(".")
        for names in FUSED_SIBLINGS:
            if leaf in names:
                groups.setdefault(("siblings", parent, names), []).append(module)
        experts = re.match(r"^(.*\.experts)\.\d+\.([^.]+)$", module)
        if experts:
            groups.setdefault(("experts", experts.group(1), experts.group(2)), []).append(module)
    bad = [sorted(members, key=_natural) for members in groups.values()
           if len({_format_label(a.declared[m]) for m in members}) > 1]
    if bad:
        example = ", ".join(f"{m}={_format_label(a.declared[m])}" for m in bad[0][:4])
        a.add(ERROR, "format", [m for members in bad for m in members], f"{len(bad)} group(s) of layers that "
              f"engines fuse have different formats or group sizes (e.g. {example})",
              "export checks equal formats only when the group's first member is not FP8 (\"Modules have "
              "different quantization formats\"), and never across experts: a per-layer search, a hand "
              "config, or experts that received no calibration tokens left one group in several formats; "
              "engines fusing q/k/v, gate/up or the experts refuse it or run one format for all",
              consequence=("vLLM and TensorRT-LLM fuse these layers into one GEMM with one format: they refuse the "
                           "checkpoint ('different quantization formats') or run one member's format for all"),
              fix=("give every member of a fused group one format and group size (the search's groups do) "
                   "and re-export"))


def _format_label(fmt: LayerFormat | None) -> str:
    """FP8, W4A16_AWQ/64, none."""
    if fmt is None:
        return "none"
    return fmt.quant_algo + (f"/{fmt.group_size}" if fmt.group_size else "")


def _kept_high_precision(module: str, head: str | None) -> bool:
    """Modules ModelOpt's recipes never quantize: the output head, MoE routers, vision towers."""
    parts = module.split(".")
    return module == head or parts[-1] in HIGH_PRECISION_NAMES or any("vision" in p or "visual" in p for p in parts)
