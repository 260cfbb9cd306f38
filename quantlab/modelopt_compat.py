"""Where ModelOpt 0.47 and transformers 5 disagree, the smallest adjustments that let a verified export happen.

Fused MoE experts (transformers 5 stores them as 3-D parameters, ModelOpt wraps them as _QuantFusedExperts):
- export's re-smoothing walks `len(module.experts)`, which fused experts do not have: they are skipped (AWQ and
  SmoothQuant never smoothed them: they act on 2-D linears only);
- a per-expert weight quantizer keeps the fused slice's export shape, which breaks the gate/up split of INT4 blocks:
  its amax is given the shape the export asks for;
- an expert that no calibration token reached has no weight amax under AWQ: it gets per-block round-to-nearest
  scales from its own weights (what max calibration gives every expert), so no expert ships uncalibrated.
Each adjustment is logged with the module it touched.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

log = logging.getLogger("quantlab")
EXPERT_QUANTIZERS = ("gate_up_proj_weight_quantizers", "down_proj_weight_quantizers")


def has_fused_experts(model) -> bool:
    """Whether ModelOpt quantized a model whose experts are fused 3-D parameters."""
    return any(hasattr(m, EXPERT_QUANTIZERS[0]) for m in model.modules())


@contextmanager
def fused_experts_resmooth():
    """Export's re-smoothing skips fused experts (it would take len() of them)."""
    import modelopt.torch.export.unified_export_hf as ueh

    original = ueh.get_experts_list

    def experts_list(module, model_type):
        if not hasattr(getattr(module, "experts", None), "__len__"):
            return []
        return original(module, model_type)

    ueh.get_experts_list = experts_list
    try:
        yield
    finally:
        ueh.get_experts_list = original


def prepare_fused_experts(model) -> list[str]:
    """Give every per-expert weight quantizer an amax of the shape export expects; returns the adjusted names."""
    import torch

    touched = []
    for name, module in model.named_modules():
        for attr in EXPERT_QUANTIZERS:
            quantizers = getattr(module, attr, None)
            if not quantizers:
                continue
            weights = getattr(module, attr.replace("_weight_quantizers", ""))
            for e, q in enumerate(quantizers):
                if not getattr(q, "is_enabled", False):
                    continue
                blocks = getattr(q, "block_sizes", None) or {}
                shape = getattr(q, "_amax_shape_for_export", None)
                amax = getattr(q, "_amax", None)
                if amax is None and blocks.get("type") == "static" and blocks.get(-1):
                    w = weights[e].detach().float()
                    with torch.no_grad():
                        q.amax = w.reshape(w.shape[0], -1, blocks[-1]).abs().amax(-1)
                    touched.append(f"{name}.{attr}.{e} (no calibration token: round-to-nearest block scales)")
                elif shape is not None and amax is not None:
                    reshaped = amax.reshape(shape).clone()
                    delattr(q, "_amax")
                    q.amax = reshaped
                else:
                    continue
                if hasattr(q, "_amax_shape_for_export"):
                    del q._amax_shape_for_export
    for line in touched:
        log.warning("export: %s", line)
    return touched
