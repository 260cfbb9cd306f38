"""declarations: the three statements of what the checkpoint is agree. config.json's quantization_config (what vLLM and
SGLang read: quant_method, quant_algo, config_groups' bits and types, group_size, kv_cache_scheme, ignore,
quantized_layers) against hf_quant_config.json (what TensorRT-LLM reads: quant_algo, kv_cache_quant_algo, group_size,
exclude_modules, quantized_layers), and both against the tensors (the format check reads every quantized layer with
the format hf_quant_config.json declares; here: the KV cache scheme against the k_scale / v_scale tensors)."""
from __future__ import annotations

import json

from quantlab.audit.report import ERROR
from quantlab.audit.state import AuditState

# quant_algo -> (weight bits, weight type or None: either, activation bits or None: weight-only, activation type)
FORMAT_BITS = {
    "FP8": (8, "float", 8, "float"),
    "FP8_PER_CHANNEL_PER_TOKEN": (8, "float", 8, "float"),
    "W8A8_SQ_PER_CHANNEL": (8, "int", 8, "int"),
    "W4A16_AWQ": (4, "int", None, None),
    "W4A8_AWQ": (4, None, 8, "float"),
    "NVFP4": (4, "float", 4, "float"),
}
KV_SCHEMES = {"FP8": (8, "float"), "INT8": (8, "int"), "NVFP4": (4, "float")}
READERS = ("vLLM and SGLang read config.json's quantization_config, TensorRT-LLM reads hf_quant_config.json "
           "(transformers-based tools read config.json)")
FIX = ("re-export, or make both files say what the tensors hold (quantlab's audit names the tensors' format under "
       "format): edit the one that is wrong, never only one of them")


def check_declarations(a: AuditState) -> None:
    """config.json's quantization_config against hf_quant_config.json, and the KV cache scheme against the tensors."""
    q, declared = a.config.get("quantization_config"), a.quant
    if not isinstance(q, dict):
        a.add(ERROR, "declarations", [], "config.json has no quantization_config although hf_quant_config.json "
              f"declares {declared.quant_algo}",
              "config.json was replaced by the unquantized model's (copied over the export, or saved again by "
              "transformers)", consequence="vLLM / SGLang / transformers load the stored codes as plain weights "
              "(FP8 / INT8 codes read as values, packed int4 refused for its shape); TensorRT-LLM still reads "
              "hf_quant_config.json: engines disagree", fix=FIX)
        return
    problems: list[tuple[list[str], str]] = []
    if q.get("quant_method", "modelopt") != "modelopt":
        problems.append(([], f"config.json's quant_method is {q.get('quant_method')!r}, not 'modelopt'"))
    if q.get("quant_algo") != declared.quant_algo:
        problems.append(([], f"config.json says quant_algo={q.get('quant_algo')}, hf_quant_config.json says "
                             f"{declared.quant_algo}"))
    problems += _kv_problems(a, q)
    problems += _group_problems(a, q)
    problems += _layer_problems(a, q)
    if not declared.mixed and isinstance(q.get("ignore"), list) and \
            sorted(q["ignore"]) != sorted(declared.exclude_modules):
        only_cfg = sorted(set(q["ignore"]) - set(declared.exclude_modules))
        only_hf = sorted(set(declared.exclude_modules) - set(q["ignore"]))
        problems.append((only_cfg + only_hf, "config.json's ignore and hf_quant_config.json's exclude_modules list "
                                             f"different modules (only in ignore: {only_cfg[:3]}, only in "
                                             f"exclude_modules: {only_hf[:3]})"))
    for modules, text in problems:
        a.add(ERROR, "declarations", modules, text,
              "one of the two files was edited, written by another tool, or comes from another export of the model",
              consequence=READERS + ": the engines run different formats, KV caches or module sets from one "
              "checkpoint, and at least one of them misreads the tensors", fix=FIX)


def _kv_problems(a: AuditState, q: dict) -> list[tuple[list[str], str]]:
    """kv_cache_scheme (a dict of num_bits / type, or a string) against kv_cache_quant_algo and the KV tensors."""
    scheme, algo = q.get("kv_cache_scheme"), a.quant.kv_cache_quant_algo
    if not scheme and not algo:
        return []
    if bool(scheme) != bool(algo):
        return [([], f"config.json {'has' if scheme else 'has no'} kv_cache_scheme"
                     + (f" ({json.dumps(scheme)})" if scheme else "")
                     + f", hf_quant_config.json says kv_cache_quant_algo={algo}")]
    if isinstance(scheme, str):
        return [] if scheme.upper() == str(algo).upper() else \
            [([], f"config.json's kv_cache_scheme {scheme!r}, hf_quant_config.json's kv_cache_quant_algo {algo}")]
    if not isinstance(scheme, dict):
        return [([], f"config.json's kv_cache_scheme is {json.dumps(scheme)[:60]}, neither an object nor a name")]
    want = KV_SCHEMES.get(str(algo).upper())
    got = (scheme.get("num_bits"), scheme.get("type"))
    if want is not None and got != want:
        return [([], f"config.json's kv_cache_scheme is {got[0]}-bit {got[1]}, hf_quant_config.json's "
                     f"kv_cache_quant_algo {algo} is {want[0]}-bit {want[1]}")]
    return []


def _group_problems(a: AuditState, q: dict) -> list[tuple[list[str], str]]:
    """config_groups' weight / activation bits, types and group sizes against the declared format(s)."""
    out = []
    groups = q.get("config_groups") if isinstance(q.get("config_groups"), dict) else {}
    for name, group in groups.items():
        if not isinstance(group, dict):
            continue
        targets = group.get("targets") if a.quant.mixed else None
        algos = {a.quant.layers[t].quant_algo for t in targets or [] if t in a.quant.layers} if a.quant.mixed \
            else {a.quant.quant_algo}
        for algo in algos:
            expect = FORMAT_BITS.get(algo)
            if expect is None:
                continue
            w, act = group.get("weights") or {}, group.get("input_activations")
            wrong = []
            if w.get("num_bits") not in (None, expect[0]) or (expect[1] and w.get("type") not in (None, expect[1])):
                wrong.append(f"weights {w.get('num_bits')}-bit {w.get('type')}")
            if expect[2] is None and act:
                wrong.append("quantized input_activations (the format is weight-only)")
            elif expect[2] and isinstance(act, dict) and (act.get("num_bits"), act.get("type")) != expect[2:]:
                wrong.append(f"input_activations {act.get('num_bits')}-bit {act.get('type')}")
            size = w.get("group_size")
            declared_size = (a.quant.layers[targets[0]].group_size if a.quant.mixed and targets and
                             targets[0] in a.quant.layers else a.quant.group_size)
            if size is not None and declared_size is not None and size != declared_size:
                wrong.append(f"group_size {size} (hf_quant_config.json: {declared_size})")
            if wrong:
                out.append((list(targets or []), f"config.json's config_groups.{name} declares "
                                                 f"{', '.join(wrong)} for {algo}"))
    return out


def _layer_problems(a: AuditState, q: dict) -> list[tuple[list[str], str]]:
    """Mixed precision: config.json's quantized_layers against hf_quant_config.json's, layer by layer."""
    theirs = q.get("quantized_layers")
    if not a.quant.mixed and not theirs:
        return []
    if not isinstance(theirs, dict):
        return [([], "hf_quant_config.json lists per-layer formats (quantized_layers), config.json does not")] \
            if a.quant.mixed else []
    ours = {m: (f.quant_algo, f.group_size) for m, f in a.quant.layers.items()}
    cfg = {m: (e.get("quant_algo"), e.get("group_size")) for m, e in theirs.items() if isinstance(e, dict)}
    differ = sorted(m for m in set(ours) | set(cfg) if ours.get(m) != cfg.get(m))
    if not differ:
        return []
    m = differ[0]
    return [(differ, f"{len(differ)} layer(s) have another format in config.json's quantized_layers than in "
                     f"hf_quant_config.json's (e.g. {m}: {cfg.get(m)} vs {ours.get(m)})")]
