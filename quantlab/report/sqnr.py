"""Per-layer quantization error of the exported weights: SQNR = 10 log10(|W|^2 / |W - dequant(Q)|^2).

The exported weight of a smoothed layer (SmoothQuant, AWQ) approximates W / pre_quant_scale, so that is what it
is compared with. Where export folded the scale into the preceding norm (layers sharing an input), the scale is
recovered as exported_norm / original_norm.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from quantlab.engines.qlayers import unpack_int4
from quantlab.stages.prepare import tensor_index

# Which norm feeds which projection, for the Llama / Qwen2 / Mistral layout.
NORM_OF = {"q_proj": "input_layernorm", "k_proj": "input_layernorm", "v_proj": "input_layernorm",
           "gate_proj": "post_attention_layernorm", "up_proj": "post_attention_layernorm"}


def _dequant(t, layer: str, algo: str, block: int | None) -> torch.Tensor:
    w = t[f"{layer}.weight"].get_tensor(f"{layer}.weight")
    s = t[f"{layer}.weight_scale"].get_tensor(f"{layer}.weight_scale").float()
    if algo == "FP8":
        return w.float() * s
    if algo == "W8A8_SQ_PER_CHANNEL":
        return w.float() * s[:, None]
    return unpack_int4(w).float() * s.repeat_interleave(block, dim=1)


def weight_sqnr(checkpoint: Path, original: Path) -> list[dict]:
    quant = json.loads((checkpoint / "hf_quant_config.json").read_text())["quantization"]
    algo, block = quant.get("quant_algo"), quant.get("group_size")
    if algo not in ("FP8", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ"):
        return []
    exp, orig = tensor_index(checkpoint), tensor_index(original)
    rows = []
    for key in sorted(exp, key=_layer_order):
        if not key.endswith(".weight_scale"):
            continue
        layer = key[: -len(".weight_scale")]
        if f"{layer}.weight" not in orig:
            continue
        w = orig[f"{layer}.weight"].get_tensor(f"{layer}.weight").float()
        pqs = _pre_quant_scale(exp, orig, layer, w.shape[1])
        target = w / pqs[None, :]
        err = target - _dequant(exp, layer, algo, block)
        noise = float(err.pow(2).sum())
        sqnr = 10 * math.log10(float(target.pow(2).sum()) / noise) if noise > 0 else float("inf")
        rows.append({"layer": layer, "sqnr_db": sqnr, "shape": list(w.shape)})
    return rows


def _pre_quant_scale(exp, orig, layer: str, k: int) -> torch.Tensor:
    name = f"{layer}.pre_quant_scale"
    if name in exp:
        return exp[name].get_tensor(name).float()
    parent, _, proj = layer.rpartition(".")
    norm = NORM_OF.get(proj)
    if norm:
        block = parent.rpartition(".")[0]  # model.layers.N
        key = f"{block}.{norm}.weight"
        if key in exp and key in orig:
            new, old = exp[key].get_tensor(key).float(), orig[key].get_tensor(key).float()
            ratio = torch.where(old.abs() > 0, new / old, torch.ones_like(new))
            if ratio.shape[0] == k:
                return ratio
    return torch.ones(k)


def _layer_order(key: str) -> tuple:
    """model.layers.10.x sorts after model.layers.9.x."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("."))
