"""build: turn what the run produced into an engine. A registry maps engine name -> builder.

Build limits (max_input_len, max_seq_len, max_batch_size) are part of every engine; requests over them fail
with an error naming the limit, and the evaluation is checked against them before any compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from quantlab.config import EngineConfig
from quantlab.engines.base import Engine, Limits
from quantlab.errors import QuantlabError


@dataclass
class BuildContext:
    ref: object  # ModelRef
    device: object  # Device
    dtype: object
    device_map: str | None
    restore_fakequant: Callable[[], object]  # -> the calibrated fake-quant model
    checkpoint: Callable[[], object]  # -> the export Artifact
    store: object


def limits_for(cfg: EngineConfig, max_positions: int | None) -> Limits:
    cap = max_positions or 1 << 20
    max_seq = cfg.max_seq_len or cap
    max_in = cfg.max_input_len or max_seq
    for knob, value in (("engine.max_seq_len", max_seq), ("engine.max_input_len", max_in)):
        if value > cap:
            raise QuantlabError(f"{knob}={value} is over the model's max positions ({cap})", fix=f"set {knob} <= {cap}")
    if max_in > max_seq:
        raise QuantlabError(f"engine.max_input_len={max_in} is over engine.max_seq_len={max_seq}")
    return Limits(max_input_len=max_in, max_seq_len=max_seq, max_batch_size=cfg.max_batch_size)


def _reference(cfg: EngineConfig, ctx: BuildContext, limits: Limits) -> Engine:
    from quantlab.engines.hf import HFModelEngine
    from quantlab.stages.prepare import load_model

    return HFModelEngine(load_model(ctx.ref, ctx.device, ctx.dtype, ctx.device_map), limits, "reference")


def _fakequant(cfg: EngineConfig, ctx: BuildContext, limits: Limits) -> Engine:
    from quantlab.engines.hf import HFModelEngine

    return HFModelEngine(ctx.restore_fakequant(), limits, "fakequant")


def _as_exported(ctx: BuildContext):
    """Fake-quant model with the transformations export applies (ModelOpt re-smooths layers that share an
    input, e.g. q/k/v, to one averaged pre_quant_scale and re-quantizes their weights)."""
    import torch
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    model = ctx.restore_fakequant()
    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)
    return model


def _fakequant_exported(cfg: EngineConfig, ctx: BuildContext, limits: Limits) -> Engine:
    from quantlab.engines.hf import HFModelEngine

    return HFModelEngine(_as_exported(ctx), limits, "fakequant_exported")


def _fakequant_jitter(cfg: EngineConfig, ctx: BuildContext, limits: Limits) -> Engine:
    """The as-exported fake-quant model with embeddings scaled by (1 + s N(0,1)), s = max(1e-6, the compute
    dtype's eps): how far a quantized model's top-1 moves under rounding-sized noise. No engine that is not
    bit-identical to fake-quant can be expected to agree with it better."""
    import torch

    from quantlab.engines.hf import HFModelEngine

    model = _as_exported(ctx)
    emb = model.get_input_embeddings().weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    # Noise the size of rounding in the compute dtype (1e-6 would vanish in bf16, whose ulp is 7.8e-3).
    scale = max(JITTER, torch.finfo(emb.dtype).eps)
    with torch.no_grad():
        noise = (scale * torch.randn(emb.shape, generator=gen)).to(emb.device)
        emb.copy_((emb.float() * (1 + noise)).to(emb.dtype))
    return HFModelEngine(model, limits, "fakequant_jitter")


def _torch(cfg: EngineConfig, ctx: BuildContext, limits: Limits) -> Engine:
    from quantlab.engines.torch_engine import build_torch_engine

    return build_torch_engine(ctx, limits)


def _trtllm(cfg: EngineConfig, ctx: BuildContext, limits: Limits) -> Engine:
    from quantlab.engines.trtllm import build_trtllm_engine

    return build_trtllm_engine(cfg, ctx, limits)


JITTER = 1e-6

BUILDERS: dict[str, Callable[[EngineConfig, BuildContext, Limits], Engine]] = {
    "reference": _reference, "fakequant": _fakequant, "fakequant_exported": _fakequant_exported,
    "fakequant_jitter": _fakequant_jitter, "torch": _torch,
    "trtllm": _trtllm,
}


def build(name: str, cfg: EngineConfig, ctx: BuildContext, limits: Limits) -> Engine:
    return BUILDERS[name](cfg, ctx, limits)
