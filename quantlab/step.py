"""Declared steps: what a run's steps are made of (Step) and what they share (RunContext). Stages declare their
steps with these; quantlab.graph lists them and interprets them. Nothing here imports a stage."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Protocol

from quantlab.artifacts import Artifact, ArtifactStore, Built
from quantlab.config import Config
from quantlab.engines.registry import ATTRIBUTION_RUNGS, EngineSpec, engine_of
from quantlab.env import Device
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
    key: Callable[[Resolver], str | None]
    load: Callable[[Artifact | None, Resolver, Built | None], Any]
    build: Callable[[Path | None, Resolver], Any] | None = None
    needs: tuple[str, ...] = ()
    work: Callable[[Resolver], dict | None] | None = None
    manifest: Callable[[Resolver], dict] = field(default=lambda r: {})
    source: str | None = None  # local | external
    store_stage: str | None = None  # artifact directory when it differs from the stage (reference, evaluate)
    describe: str = ""
    cheap: bool = False  # its value may be loaded while planning (model refs, token sets)
    target: bool = True  # materialized by a run that ends at its stage (False: only when another step reads it)
    probe: Callable[[Resolver], tuple[str, str]] | None = None  # (directory, key) of the first artifact an uncached
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


class Resolver(Protocol):
    """What a step's key, build, load, work, manifest and probe functions are given: the run's two interpreters,
    quantlab.graph.Executor (loads or builds) and quantlab.graph.Pricer (prices without building), both satisfy it."""

    ctx: RunContext

    @property
    def store(self) -> ArtifactStore:
        """The run's artifact store."""

    def has(self, name: str) -> bool:
        """Whether the run has a step called name."""

    def key(self, name: str) -> str | None:
        """The step's cache key (None: an action, never cached)."""

    def fingerprint(self, name: str) -> str:
        """The step's fingerprint."""

    def value(self, name: str) -> Any:
        """The step's value (the Pricer raises Pending for one not built yet)."""
