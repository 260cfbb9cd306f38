"""Per-layer quantization error of the exported weights: SQNR = 10 log10(|W|^2 / |W - dequant(Q)|^2).

The exported weight of a smoothed layer (SmoothQuant, AWQ) approximates W / pre_quant_scale, so that is what it
is compared with. Where export folded the scale into the preceding norm (layers sharing an input), the scale is
recovered as exported_norm / original_norm.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from quantlab.checkpoint import CheckpointTensors, read_quant_config, tensor_index
from quantlab.engines.qlayers import QLAYERS, LayerContext

# Which norm feeds which projection, for the Llama / Qwen2 / Mistral layout.
NORM_OF = {"q_proj": "input_layernorm", "k_proj": "input_layernorm", "v_proj": "input_layernorm",
           "gate_proj": "post_attention_layernorm", "up_proj": "post_attention_layernorm"}


def weight_sqnr(checkpoint: Path, original: Path) -> list[dict]:
    """One row per quantized Linear of a format engine=torch knows: layer, SQNR in dB, shape."""
    quant = read_quant_config(checkpoint)
    if quant is None:
        return []
    exp, orig = CheckpointTensors(checkpoint), tensor_index(original)
    ctx = LayerContext("cpu", False, torch.float32)
    rows = []
    for key in sorted(exp.names(), key=_layer_order):
        if not key.endswith(".weight_scale"):
            continue
        layer = key[: -len(".weight_scale")]
        fmt = quant.format_of(layer)
        if fmt is None or fmt.quant_algo not in QLAYERS or f"{layer}.weight" not in orig:
            continue
        w = orig[f"{layer}.weight"].get_tensor(f"{layer}.weight").float()
        dequant = QLAYERS[fmt.quant_algo].from_checkpoint(layer, w.shape[0], w.shape[1], False, exp, fmt, ctx)
        pqs = _pre_quant_scale(exp.where, orig, layer, w.shape[1])
        target = w / pqs[None, :]
        err = target - dequant.dequantized_weight()
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
