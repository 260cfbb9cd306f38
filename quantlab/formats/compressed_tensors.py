"""compressed-tensors checkpoints (llm-compressor's `save_pretrained(..., save_compressed=True)`, what vLLM loads):
config.json's quantization_config (quant_method "compressed-tensors", quantization_status "compressed") declares
config_groups, each with targets, weight and input-activation arguments and a storage format, an ignore list and an
optional kv_cache_scheme; the tensors sit under the module names (weight / weight_packed, weight_scale,
weight_zero_point, weight_shape, input_scale; <attention>.k_scale / v_scale for the KV cache).

Read: float-quantized (FP8 E4M3), int-quantized / naive-quantized (INT8) and pack-quantized (int2 / int4 / int8)
weights with tensor, channel, group or block scales, symmetric or asymmetric; activations none, dynamic per token or
static per tensor (symmetric); an FP8 per-tensor static KV cache. Refused by name: act-order (actorder group /
dynamic, weight_g_idx: compressed-tensors 0.19 itself rejects them), sparsity configs, formats such as
nvfp4-pack-quantized or marlin-24, asymmetric or per-group activations, other KV cache schemes, and transforms
applied at run time (transform_config locations input / output / q_attn / k_cache: quantlab's engine does not apply
them) and, named apart, rotations fused into the weights (weight_input / weight_output: the audit does not compare
through a rotation). Smoothing scales moved between layers need no declaration: the audit infers them
(quantlab.audit.equivalence), and recipe_mappings reads the ones recipe.yaml declares."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from quantlab.checkpoint import CheckpointTensors, read_json_file, safetensors_files
from quantlab.formats.base import CheckpointFormat, ForeignLayer, Opened, declared, refuse

QUANT_METHOD = "compressed-tensors"
STORAGE = {"float-quantized": "float", "int-quantized": "int", "naive-quantized": None, "pack-quantized": "packed"}
STRATEGIES = ("tensor", "channel", "group", "block")
FIX = ("quantlab reads compressed-tensors' float-, int- and pack-quantized formats; re-save with llm-compressor "
       "using one of those schemes (e.g. FP8_DYNAMIC, W8A8, W4A16)")


def quantization_config(path: Path) -> dict | None:
    """config.json's quantization_config when it is an object, else None (no config.json, or none declared)."""
    file = path / "config.json"
    if not (path.is_dir() and file.is_file()):
        return None
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    qc = doc.get("quantization_config") if isinstance(doc, dict) else None
    return qc if isinstance(qc, dict) else None


def detect(path: Path) -> bool:
    """A directory whose config.json says quant_method compressed-tensors."""
    qc = quantization_config(path)
    return qc is not None and qc.get("quant_method") == QUANT_METHOD


def _weights(path: Path, group: str, storage: str, w) -> dict:
    """A group's weight arguments, checked: what the engine needs to read them."""
    if not isinstance(w, dict):
        raise refuse(path, f"config_groups.{group} quantizes no weights (weights={w!r})", FIX)
    kind, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy")
    actorder = w.get("actorder")
    if actorder not in (None, "static", "weight"):
        raise refuse(path, f"config_groups.{group}.weights.actorder={actorder!r}: activation ordering with "
                     "weight_g_idx is rejected by compressed-tensors 0.19 itself (\"actorder='group' has been "
                     "removed\"), so no current loader reads this checkpoint",
                     "re-quantize with actorder='static' (or 'weight'), which needs no g_idx")
    if w.get("dynamic") not in (False, None):
        raise refuse(path, f"config_groups.{group}.weights.dynamic={w.get('dynamic')!r}: weights quantized at run "
                     "time are not a stored format", FIX)
    if strategy not in STRATEGIES:
        raise refuse(path, f"config_groups.{group}.weights.strategy={strategy!r} (quantlab reads "
                     f"{', '.join(STRATEGIES)})", FIX)
    expected = {"float": ("float", (8,)), "int": ("int", (8,)), "packed": ("int", (2, 4, 8))}[storage]
    if kind != expected[0] or bits not in expected[1]:
        raise refuse(path, f"config_groups.{group}: {kind} {bits}-bit weights in a {storage} storage format "
                     f"(quantlab reads {expected[0]} {'/'.join(map(str, expected[1]))}-bit there)", FIX)
    block = w.get("block_structure")
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2 and all(
            type(b) is int and b > 0 for b in block)):
        raise refuse(path, f"config_groups.{group}.weights.block_structure={block!r} is not [rows, columns]", FIX)
    group_size = w.get("group_size")
    if strategy == "group" and not (type(group_size) is int and group_size > 0):
        raise refuse(path, f"config_groups.{group}.weights.group_size={group_size!r} is not a positive integer", FIX)
    return {"kind": kind, "bits": bits, "strategy": strategy, "symmetric": bool(w.get("symmetric", True)),
            "group_size": group_size if strategy == "group" else None,
            "block": tuple(block) if strategy == "block" else None}


def _activations(path: Path, group: str, a) -> dict:
    """A group's input-activation arguments: none, dynamic per token, or static per tensor, symmetric."""
    if a is None:
        return {"activations": None}
    if not isinstance(a, dict):
        raise refuse(path, f"config_groups.{group}.input_activations is not an object", FIX)
    kind, bits, strategy, dynamic = a.get("type", "int"), a.get("num_bits", 8), a.get("strategy"), a.get("dynamic")
    if not a.get("symmetric", True):
        raise refuse(path, f"config_groups.{group}: asymmetric input activations (zero points at run time)",
                     "quantlab runs symmetric activation quantization only; re-quantize with symmetric=True")
    if (kind, bits) not in (("int", 8), ("float", 8)):
        raise refuse(path, f"config_groups.{group}: {kind} {bits}-bit input activations", FIX)
    if dynamic is True and strategy == "token":
        mode = "dynamic_token"
    elif dynamic in (False, None) and strategy == "tensor":
        mode = "static_tensor"
    else:
        raise refuse(path, f"config_groups.{group}: input activations strategy={strategy!r} dynamic={dynamic!r} "
                     "(quantlab runs dynamic per-token and static per-tensor)", FIX)
    return {"activations": mode, "act_type": kind, "act_bits": bits}


def _algo(storage: str, spec: dict, gptq: bool = False) -> str:
    if storage == "packed":
        return f"CT_PACKED_INT{spec['bits']}" + ("_GPTQ" if gptq and spec["bits"] < 8 else "")
    return "CT_FP8" if spec["kind"] == "float" else "CT_INT8"


def _target_kind(path: Path, where: str, target) -> None:
    if not isinstance(target, str):
        raise refuse(path, f"{where} holds {target!r}, not a module name, pattern or class", FIX)
    if not (target == "Linear" or target.startswith("re:") or "." in target or target.islower()
            or "_" in target):
        raise refuse(path, f"{where} targets the module class {target!r}; quantlab resolves 'Linear', module names "
                     "and re: patterns", "re-quantize with targets=['Linear'] or explicit patterns")


def matches(module: str, targets: list[str]) -> int | None:
    """compressed-tensors' matching of a Linear module against targets: 0 for its exact name, 1 for a re: pattern
    (re.match on the name), 2 for the class 'Linear'; None when nothing matches. Lower is more specific."""
    best = None
    for target in targets:
        if target == module:
            rank = 0
        elif target.startswith("re:") and re.match(target[3:], module):
            rank = 1
        elif target == "Linear":
            rank = 2
        else:
            continue
        best = rank if best is None else min(best, rank)
    return best


def _groups(path: Path, qc: dict) -> list[tuple[str, list[str], ForeignLayer, dict]]:
    """(name, targets, layer format, raw group) per config group, checked."""
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise refuse(path, "quantization_config has no config_groups", FIX)
    out = []
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise refuse(path, f"config_groups.{name} is not an object", FIX)
        fmt_name = g.get("format") or qc.get("format")
        if fmt_name not in STORAGE:
            raise refuse(path, f"config_groups.{name} is stored as {fmt_name!r}", FIX)
        w = g.get("weights") if isinstance(g.get("weights"), dict) else {}
        storage = STORAGE[fmt_name] or ("float" if w.get("type") == "float" else "int")
        spec = _weights(path, name, storage, g.get("weights"))
        if g.get("output_activations") is not None:
            raise refuse(path, f"config_groups.{name} quantizes output activations", FIX)
        act = _activations(path, name, g.get("input_activations"))
        targets = g.get("targets") or []
        for target in targets:
            _target_kind(path, f"config_groups.{name}.targets", target)
        algo = _algo(storage, spec, _made_by_gptq(path))
        layer = ForeignLayer(algo, spec["group_size"], bits=spec["bits"], symmetric=spec["symmetric"],
                             strategy=spec["strategy"], block=spec["block"], marker="weight_scale", **act)
        out.append((name, list(targets), layer, g))
    return out


OFFLINE = ("weight_input", "weight_output")  # fused into the stored weights when the checkpoint was saved
ONLINE = {"input": "the input activations of", "output": "the output activations of",
          "q_attn": "the queries (after RoPE) of", "k_cache": "the keys entering the KV cache of"}
TRANSFORM_FIX = ("quantlab's engine runs the stored weights and applies no transform at run time: re-quantize with "
                 "offline rotations only (llm-compressor SpinQuantModifier(rotations=['R1', 'R2'])), or serve and "
                 "evaluate this checkpoint with an engine that applies compressed-tensors' online transforms (vLLM)")


ROTATION_FIX = ("re-quantize without rotation modifiers (SpinQuantModifier, QuIPModifier: AWQ or GPTQ alone) to "
                "evaluate with quantlab, or evaluate this checkpoint with the serving engine it was made for (vLLM)")


def offline_transforms(path: Path, qc: dict) -> list[dict]:
    """compressed-tensors' transform_config (config_groups of TransformSchemes: type, apply = [{targets, location,
    inverse, ignore}], head_dim), checked: one applied at run time (location input / output / q_attn / k_cache:
    SpinQuant R3 / R4, QuIP's Hadamards) is refused, naming it: a checkpoint that needs it computes something else
    without it. Every transform fused into the weights (locations weight_input / weight_output only: SpinQuant R1 /
    R2, QuaRot's offline rotations) is returned as {name, type, head_dim, apply} (open_ct refuses those too,
    named apart: the audit does not compare through a rotation)."""
    tc = qc.get("transform_config")
    if not tc:
        return []
    groups = tc.get("config_groups") if isinstance(tc, dict) else None
    if not isinstance(groups, dict):
        raise refuse(path, f"transform_config {json.dumps(tc)[:160]} has no config_groups object", TRANSFORM_FIX)
    out = []
    for name, scheme in groups.items():
        apply = scheme.get("apply") if isinstance(scheme, dict) else None
        if not isinstance(apply, list) or not all(isinstance(x, dict) for x in apply):
            raise refuse(path, f"transform_config.config_groups.{name} has no list of apply entries", TRANSFORM_FIX)
        for entry in apply:
            location = entry.get("location")
            if location in ONLINE:
                targets = ", ".join(map(str, entry.get("targets") or []))[:120]
                raise refuse(path, f"transform_config.config_groups.{name} applies a {scheme.get('type', '?')} "
                             f"transform at run time (location {location!r}: {ONLINE[location]} {targets}), which "
                             "quantlab's engine cannot apply: evaluated as plain weights it would compute another "
                             "function", TRANSFORM_FIX)
            if location not in OFFLINE:
                raise refuse(path, f"transform_config.config_groups.{name}: unknown transform location "
                             f"{location!r}", TRANSFORM_FIX)
        out.append({"name": str(name), "type": str(scheme.get("type", "?")), "head_dim": scheme.get("head_dim"),
                    "apply": apply})
    return out


def recipe_mappings(path: Path) -> list[tuple[str, list[str]]]:
    """The smoothing mappings llm-compressor's recipe.yaml beside the checkpoint declares (AWQModifier /
    SmoothQuantModifier mappings: [smooth_layer, balance_layers] or {smooth_layer, balance_layers}), as
    (producer pattern, consumer patterns); [] when there is no recipe or it declares none."""
    recipe = Path(path) / "recipe.yaml" if Path(path).is_dir() else None
    if recipe is None or not recipe.is_file():
        return []
    import yaml  # PyYAML: installed with omegaconf

    try:
        doc = yaml.safe_load(recipe.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError, yaml.YAMLError):
        return []
    found: list[tuple[str, list[str]]] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "mappings" and isinstance(value, list):
                    found.extend(m for m in map(_mapping, value) if m)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(doc)
    return found


def _mapping(entry) -> tuple[str, list[str]] | None:
    if isinstance(entry, dict):
        smooth, balance = entry.get("smooth_layer"), entry.get("balance_layers")
    elif isinstance(entry, list) and len(entry) == 2:
        balance, smooth = entry  # SmoothQuant's [[balance layers], smooth layer]
    else:
        return None
    if isinstance(balance, str):
        balance = [balance]
    if not isinstance(smooth, str) or not isinstance(balance, list):
        return None
    return smooth, [str(b) for b in balance]


def _made_by_gptq(path: Path) -> bool:
    """llm-compressor's recipe.yaml beside the checkpoint names GPTQModifier (the weights were GPTQ-compensated)."""
    recipe = path / "recipe.yaml"
    try:
        return recipe.is_file() and "GPTQModifier" in recipe.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def _kv(path: Path, qc: dict) -> str | None:
    kv = qc.get("kv_cache_scheme")
    if kv is None:
        return None
    if not (isinstance(kv, dict) and kv.get("type") == "float" and kv.get("num_bits") == 8
            and kv.get("strategy") == "tensor" and not kv.get("dynamic") and kv.get("symmetric", True)):
        raise refuse(path, f"kv_cache_scheme {json.dumps(kv)[:200]} (quantlab runs the FP8 per-tensor static KV "
                     "cache)", "re-quantize with kv_cache_scheme {type: float, num_bits: 8, strategy: tensor}")
    return "FP8"


def _describe(layer: ForeignLayer) -> str:
    kind = {"CT_FP8": "fp8", "CT_INT8": "int8"}.get(layer.quant_algo, f"int{layer.bits} packed")
    cover = {"group": f"group {layer.group_size}", "block": f"block {layer.block}"}.get(layer.strategy,
                                                                                        layer.strategy)
    act = ("weight-only" if layer.activations is None else
           f"{'fp8' if layer.act_type == 'float' else 'int8'} activations "
           f"{'per token (dynamic)' if layer.activations == 'dynamic_token' else 'per tensor (static)'}")
    return f"{kind} weights ({cover}, {'symmetric' if layer.symmetric else 'asymmetric'}), {act}"


def open_ct(path: Path) -> Opened:
    """The declaration checked, every group's format resolved per module, the tensors indexed."""
    qc = quantization_config(path) or {}
    status = qc.get("quantization_status")
    if status != "compressed":
        raise refuse(path, f"quantization_status={status!r}: the weights are not stored compressed",
                     "save with model.save_pretrained(out, save_compressed=True)")
    if qc.get("sparsity_config"):
        raise refuse(path, f"sparsity_config is set ({json.dumps(qc['sparsity_config'])[:120]}): sparse weights", FIX)
    fused = offline_transforms(path, qc)
    if fused:
        named = "; ".join(f"config_groups.{t['name']} ({t['type']} on " + ", ".join(
            f"{e.get('location')} of {', '.join(map(str, e.get('targets') or []))[:60]}" for e in t["apply"]) + ")"
            for t in fused[:3])
        raise refuse(path, f"transform_config rotates the weights ({named[:300]}): fused into the stored weights, "
                     "so the checkpoint computes the reference's function, but quantlab's audit compares every "
                     "layer with the reference and does not undo a rotation: it would call every rotated layer a "
                     "fault", ROTATION_FIX)
    groups = _groups(path, qc)
    ignore = qc.get("ignore") or []
    for target in ignore:
        _target_kind(path, "ignore", target)
    kv = _kv(path, qc)
    tensors = CheckpointTensors(path)
    act_order = [n for n in tensors.names() if n.endswith(".weight_g_idx")]
    if act_order:
        raise refuse(path, f"tensor {act_order[0]} (activation ordering): compressed-tensors 0.19 rejects "
                     "act-order checkpoints, so no current loader reads this one",
                     "re-quantize with actorder='static' (or 'weight'), which stores no g_idx")

    @functools.cache
    def resolve(module: str):
        if matches(module, ignore) is not None:
            return None
        ranked = [(matches(module, targets), i, layer) for i, (_, targets, layer, _) in enumerate(groups)]
        ranked = [r for r in ranked if r[0] is not None]
        return min(ranked, key=lambda r: (r[0], r[1]))[2] if ranked else None

    quant = declared(resolve, {layer.quant_algo for _, _, layer, _ in groups}, kv, qc,
                     groups[0][2].group_size if len(groups) == 1 else None)
    scheme = "; ".join(_describe(layer) for _, _, layer, _ in groups) + (", FP8 KV cache" if kv else "")
    config = read_json_file(path / "config.json", "config")
    return Opened(path, "compressed-tensors", f"llm-compressor / compressed-tensors {qc.get('version', '?')}",
                  scheme, quant, tensors, safetensors_files(path), config, kv_names=("k_scale", "v_scale"))


FORMAT = CheckpointFormat("compressed-tensors", "llm-compressor / compressed-tensors", detect, open_ct)
