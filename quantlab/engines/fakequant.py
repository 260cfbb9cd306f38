"""ModelOpt's fake-quant model as engines: as calibrated (engine=fakequant), as exported (with the transformations
export applies) and as exported under rounding-sized input noise (the floor of any non-identical engine). The last
two are the rungs of eval.attribution."""
from __future__ import annotations

from quantlab.engines.base import Limits
from quantlab.engines.hf import HFModelEngine

JITTER = 1e-6  # relative input noise of the jitter rung (at least the compute dtype's eps)


def plain(_engine_cfg, inputs, limits: Limits) -> HFModelEngine:
    """engine=fakequant: ModelOpt's fake-quant model as calibrated."""
    return HFModelEngine(inputs.calibrated_model(), limits, "fakequant")


def exported_model(inputs):
    """Fake-quant model with the transformations export applies (ModelOpt re-smooths layers that share an
    input, e.g. q/k/v, to one averaged pre_quant_scale and re-quantizes their weights)."""
    import torch
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    from quantlab import modelopt_compat

    model = inputs.calibrated_model()
    with torch.no_grad(), modelopt_compat.fused_experts_resmooth():
        requantize_resmooth_fused_llm_layers(model)
    return model


def as_exported(_engine_cfg, inputs, limits: Limits) -> HFModelEngine:
    """The fake-quant model after the transformations export applies (attribution rung)."""
    return HFModelEngine(exported_model(inputs), limits, "fakequant_exported")


def jittered(_engine_cfg, inputs, limits: Limits) -> HFModelEngine:
    """The as-exported fake-quant model with embeddings scaled by (1 + s N(0,1)), s = max(1e-6, the compute
    dtype's eps): how far a quantized model's top-1 moves under rounding-sized noise. No engine that is not
    bit-identical to fake-quant can be expected to agree with it better."""
    import torch

    model = exported_model(inputs)
    emb = model.get_input_embeddings().weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    # Noise the size of rounding in the compute dtype (1e-6 would vanish in bf16, whose ulp is 7.8e-3).
    scale = max(JITTER, torch.finfo(emb.dtype).eps)
    with torch.no_grad():
        noise = (scale * torch.randn(emb.shape, generator=gen)).to(emb.device)
        emb.copy_((emb.float() * (1 + noise)).to(emb.dtype))
    return HFModelEngine(model, limits, "fakequant_jitter")
