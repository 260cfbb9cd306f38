"""build: the engine under test, built from what the run has (the registry says what it runs), and its limits.

`build_engine` is how every evaluation gets its engine; `engine_step` is the step a run ends with under
stop_after=build (the engine is built, its build records stored, and the run stops). `EngineInputsView` is the
engines' view of the run being executed (quantlab.engines.base.EngineInputs): each call loads or builds the step
that provides it.
"""
from __future__ import annotations

from quantlab.config import Config
from quantlab.engines.base import Limits
from quantlab.engines.registry import EngineSpec
from quantlab.errors import QuantlabError
from quantlab.step import Resolver, RunContext, Step

RUNS_NEEDS = {"checkpoint": "export", "calibrated": "quantize", "model": "prepare"}  # the step each `runs` reads


def limits_for(cfg: Config, max_positions: int | None) -> Limits:
    """The engine's build limits (engine.max_*), defaulting to the model's max positions."""
    engine = cfg.engine
    cap = max_positions or 1 << 20
    max_seq = engine.max_seq_len or cap
    max_in = engine.max_input_len or max_seq
    for knob, value in (("engine.max_seq_len", max_seq), ("engine.max_input_len", max_in)):
        if value > cap:
            raise QuantlabError(f"{knob}={value} is over the model's max positions ({cap})", fix=f"set {knob} <= {cap}")
    if max_in > max_seq:
        raise QuantlabError(f"engine.max_input_len={max_in} is over engine.max_seq_len={max_seq}",
                            fix="raise engine.max_seq_len or lower engine.max_input_len")
    return Limits(max_input_len=max_in, max_seq_len=max_seq, max_batch_size=engine.max_batch_size)


def limits(r: Resolver) -> Limits:
    """The run's engine limits (engine.max_*, defaulting to the model's max positions), computed once; exit 2
    when they exceed the model's max positions or max_input_len > max_seq_len."""
    ctx = r.ctx
    if "limits" not in ctx.memo:
        ctx.memo["limits"] = limits_for(ctx.cfg, r.value("prepare").max_positions)
    return ctx.memo["limits"]


class EngineInputsView:
    """engines.base.EngineInputs over a run being executed: each call loads or builds what the engine runs."""

    def __init__(self, r: Resolver):
        self._r = r
        ctx = r.ctx
        self.ref, self.device, self.dtype = r.value("prepare"), ctx.device, ctx.dtype
        self.device_map, self.store = ctx.cfg.model.device_map, ctx.store

    def checkpoint(self):
        """The export step's value: the checkpoint Artifact (built, loaded, or the external one)."""
        return self._r.value("export")

    def calibrated_model(self):
        """An unused fake-quant model: the one calibration left in memory, else restored from the saved state."""
        return self._r.value("quantize").fresh()

    def reference_model(self):
        """The unquantized model, loaded anew with the run's device, dtype and device_map."""
        from quantlab.models import load_model

        return load_model(self.ref, self.device, self.dtype, self.device_map)


def build_engine(spec: EngineSpec, r: Resolver):
    """Build an engine from what the run has (the registry says what it runs)."""
    return spec.builder()(r.ctx.cfg.engine, EngineInputsView(r), limits(r))


def engine_step(ctx: RunContext) -> Step:
    """stop_after=build: build the engine under test (its build records are stored) and stop."""
    spec = ctx.engine

    def build(_out, r) -> dict:
        engine = build_engine(spec, r)
        engine.close()
        return {"engine": spec.name}

    return Step(f"build:{spec.name}", "build", lambda r: None, lambda art, r, built: built,
                build, needs=(RUNS_NEEDS[spec.runs], "prepare"))
