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


def _torch(cfg: EngineConfig, ctx: BuildContext, limits: Limits) -> Engine:
    from quantlab.engines.torch_engine import build_torch_engine

    return build_torch_engine(ctx, limits)


def _trtllm(cfg: EngineConfig, ctx: BuildContext, limits: Limits) -> Engine:
    from quantlab.engines.trtllm import build_trtllm_engine

    return build_trtllm_engine(cfg, ctx, limits)


BUILDERS: dict[str, Callable[[EngineConfig, BuildContext, Limits], Engine]] = {
    "reference": _reference, "fakequant": _fakequant, "torch": _torch, "trtllm": _trtllm,
}


def build(name: str, cfg: EngineConfig, ctx: BuildContext, limits: Limits) -> Engine:
    return BUILDERS[name](cfg, ctx, limits)
