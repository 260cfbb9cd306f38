"""Declared steps: what a run's steps are made of (Step) and what they share (RunContext). Stages declare their
steps with these; quantlab.graph lists them and interprets them. Nothing here imports a stage."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from quantlab.artifacts import Artifact, ArtifactStore, Built
from quantlab.config import Config
from quantlab.engines.base import Limits
from quantlab.engines.registry import ATTRIBUTION_RUNGS, EngineSpec, engine_of
from quantlab.env import Device
from quantlab.errors import QuantlabError
from quantlab.precisions import Precision, kv_format, precision_of


class Pending(Exception):
    """Raised while planning when a key needs a value that does not exist yet."""


@dataclass(frozen=True)
class Step:
    """One step of a run.

    key(r) -> the cache key (r.key(step) / r.fingerprint(step) / r.value(step) of other steps), or None for an
    action that is never cached. build(out, r) -> info dict or Built(info, value); only the executor calls it and
    it may read only the values of `needs`. load(artifact, r, built) -> the step's value. A `source` step ("local",
    "external") is not in the store: load(None, r, None) gives its value and its fingerprint is the value's.
    """

    name: str
    stage: str  # one of config.STAGES (stop_after cuts by it); also the artifact store's directory
    key: Callable[[Any], str | None]
    load: Callable[[Artifact | None, Any, Built | None], Any]
    build: Callable[[Path | None, Any], Any] | None = None
    needs: tuple[str, ...] = ()
    work: Callable[[Any], dict | None] | None = None
    manifest: Callable[[Any], dict] = field(default=lambda r: {})
    source: str | None = None  # local | external
    store_stage: str | None = None  # artifact directory when it differs from the stage (reference, evaluate)
    describe: str = ""
    cheap: bool = False  # its value may be loaded while planning (model refs, token sets)
    target: bool = True  # materialized by a run that ends at its stage (False: only when another step reads it)
    probe: Callable[[Any], tuple[str, str]] | None = None  # (directory, key) of the first artifact an uncached
    # step reads or writes: how the plan tells cached from to-build for steps made of many artifacts
    @property
    def directory(self) -> str:
        """The step's directory in the artifact store: store_stage when set, else its stage."""
        return self.store_stage or self.stage


# --------------------------------------------------------------------------------------------- context
@dataclass
class RunContext:
    """What every step of one run shares: the config, the store, the device and the registry entries."""

    cfg: Config
    store: ArtifactStore
    device: Device
    dtype: Any
    memo: dict = field(default_factory=dict)  # derived values shared by the steps (tokenizer, recipe, limits)

    @cached_property
    def precision(self) -> Precision:
        """The registry entry of the configured precision."""
        return precision_of(self.cfg.precision)

    @cached_property
    def engine(self) -> EngineSpec:
        """The registry entry of the configured engine."""
        return engine_of(self.cfg.engine)

    @property
    def kv_algo(self) -> str | None:
        """The kv_cache_quant_algo the configured kv_cache exports ("FP8"); None when the KV cache is not quantized."""
        return kv_format(self.cfg.kv_cache).quant_algo

    def candidates(self) -> list[str]:
        """The engine under test, plus the fake-quant rungs that eval.attribution compares it with."""
        names = [self.engine.name]
        if self.cfg.eval.attribution and self.engine.runs == "checkpoint":
            names += list(ATTRIBUTION_RUNGS)
        return names

    @property
    def external_checkpoint(self) -> str | None:
        """engine.checkpoint: a checkpoint exported elsewhere, evaluated instead of quantizing (None: quantize here)."""
        return getattr(self.cfg.engine, "checkpoint", None)


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
