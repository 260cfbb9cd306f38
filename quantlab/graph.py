"""The run as a list of declared steps: the only place that knows a run's shape.

`steps_for(ctx)` returns the steps of one run in order. Each Step says how its cache key is formed (from the keys
and fingerprints of other steps), how it is built, how its value is loaded, which steps its build reads (`needs`)
and what its build time depends on (`work`). Two interpreters read the same list:

- quantlab.pipeline executes it: `Executor.value(name)` loads or builds a step on demand, so a step is built only
  when a target needs it (the calibration is not redone when the export is cached);
- quantlab.plan prices it: `Pricer` computes the same keys without building anything and says per step whether it
  is cached, to be built, shared with an earlier run of the sweep, or not needed.

`stop_after` cuts the list after a stage. A new stage is one more Step here.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantlab import costs
from quantlab.artifacts import Artifact, ArtifactStore, Built
from quantlab.config import STAGES
from quantlab.engines.registry import ENGINES
from quantlab.step import Pending, RunContext, Step

log = logging.getLogger("quantlab")


# ------------------------------------------------------------------------------------------------ steps
def steps_for(ctx: RunContext) -> list[Step]:
    """The run's steps in order, cut after cfg.stop_after."""
    from quantlab.stages import audit, build, data, evaluate, export, prepare, quantize

    cfg = ctx.cfg
    steps = [prepare.step(ctx), data.step(ctx, data.CALIB), data.step(ctx, data.EVAL)]
    if ctx.engine.runs != "model" or cfg.stop_after in ("quantize", "export"):
        steps.append(quantize.step(ctx))
        steps.append(export.external_step(ctx) if ctx.external_checkpoint else export.step(ctx))
        if ctx.engine.runs == "checkpoint" or cfg.stop_after == "export":
            steps.append(audit.step(ctx))  # every checkpoint that would ship, before any evaluation of it
    steps.append(evaluate.reference_step(ctx))
    steps.append(build.engine_step(ctx))
    steps += [evaluate.candidate_step(ctx, ENGINES[name]) for name in ctx.candidates()]
    return cut(steps, cfg.stop_after)


def cut(steps: list[Step], stop_after: str | None) -> list[Step]:
    """Steps up to and including stop_after's stage; the engine build only when the run stops there."""
    last = STAGES.index(stop_after) if stop_after else len(STAGES) - 1
    kept = [s for s in steps if STAGES.index(s.stage) <= last]
    if stop_after != "build":
        kept = [s for s in kept if s.stage != "build"]
    return kept


def targets(steps: list[Step]) -> list[str]:
    """What a run materializes: every step of the last stage kept, and the checkpoint (the report links it)."""
    last = max(STAGES.index(s.stage) for s in steps)
    names = [s.name for s in steps if s.target and (STAGES.index(s.stage) == last or s.stage in ("prepare", "data"))]
    if any(s.name == "export" for s in steps) and "export" not in names:
        names.insert(len([n for n in names if n.startswith(("prepare", "data"))]), "export")
    if any(s.name == "audit" for s in steps) and "audit" not in names:  # every export is audited before evaluation
        names.insert(names.index("export") + 1, "audit")
    return names


# ------------------------------------------------------------------------------------------ executor
class Executor:
    """Executes steps on demand: value(name) loads or builds a step (and, through its key and build, what it
    needs). Records, per step, its artifact and its own seconds (nested builds are subtracted)."""

    def __init__(self, ctx: RunContext, steps: list[Step]):
        self.ctx = ctx
        self.steps = {s.name: s for s in steps}
        self.values: dict[str, Any] = {}
        self.artifacts: dict[str, Artifact] = {}
        self.keys: dict[str, str | None] = {}
        self.seconds: dict[str, float] = {}
        self._clock: list[float] = []  # nested time per active step
        self._building: list[Step] = []

    @property
    def store(self) -> ArtifactStore:
        """The run's artifact store."""
        return self.ctx.store

    def has(self, name: str) -> bool:
        """Whether the run has a step called name."""
        return name in self.steps

    def key(self, name: str) -> str | None:
        """The step's cache key (None: an action, never cached), formed once."""
        if name not in self.keys:
            self.keys[name] = self.steps[name].key(self)
        return self.keys[name]

    def fingerprint(self, name: str) -> str:
        """The step's fingerprint: its stored artifact's, else its value's (source steps). Loads or builds the step."""
        value = self.value(name)
        art = self.artifacts.get(name)
        return art.fingerprint if art is not None else value.fingerprint

    @contextmanager
    def _timed(self, name: str):
        start = time.time()
        self._clock.append(0.0)
        try:
            yield
        finally:
            nested = self._clock.pop()
            total = time.time() - start
            self.seconds[name] = round(self.seconds.get(name, 0.0) + total - nested, 3)
            if self._clock:
                self._clock[-1] += total

    def value(self, name: str) -> Any:
        """The step's value, loaded or built once: a source step is loaded, an action (key None) is run, any other
        step is read from the store or built into it. A step being built may read only its `needs` and cheap
        steps; reading another is an AssertionError."""
        if name in self.values:
            return self.values[name]
        step = self.steps[name]
        if self._building and name not in self._building[-1].needs and not step.cheap:
            raise AssertionError(f"step {self._building[-1].name} read {name}, which it does not declare in needs")
        with self._timed(name):
            if step.source:
                value = step.load(None, self, None)
            else:
                key = self.key(name)
                if key is None:  # an action: run it each time
                    value = step.build(None, self)
                else:
                    art, built = self.store.get_or_build(step.directory, key, lambda out: self._build(step, out),
                                                         step.manifest(self), describe=step.describe or name,
                                                         cost=step.work(self) if step.work else None)
                    self.artifacts[name] = art
                    value = step.load(art, self, built)
        self.values[name] = value
        return value

    def _build(self, step: Step, out: Path):
        self._building.append(step)
        start, nested_before = time.time(), self._clock[-1]
        try:
            result = step.build(out, self)
        finally:
            self._building.pop()
        built = result if isinstance(result, Built) else Built(result or {})
        upstream = self._clock[-1] - nested_before  # time spent making inputs belongs to their own steps
        if upstream > 0:
            built.info.setdefault("upstream_seconds", round(min(upstream, time.time() - start), 3))
        return built

    def run(self, names: list[str]) -> None:
        """Materialize the named steps in order (each loaded or built, with what it needs)."""
        for name in names:
            self.value(name)


# -------------------------------------------------------------------------------------------- pricer
@dataclass
class Priced:
    """One row of a plan: a step, its key and status (cached / build / shared / local / external / not needed /
    run), the time estimate of a step to build, and whether its key is a placeholder."""

    name: str
    stage: str
    key: str
    status: str  # cached | build | shared | local | external | not needed | run
    estimate: costs.Estimate | None = None
    placeholder: bool = False  # an input is not built yet, so the real key is known only during the run


# the configuration sections each step's key depends on (steps not listed: the whole configuration), for keys that
# cannot be formed before an input is built (a machine's first run)
_CALIBRATED = ("model", "calib", "precision", "kv_cache")
PENDING_SECTIONS = {"data:calib": ("model", "calib"), "data:eval": ("model", "eval"),
                    "reference": ("model", "eval", "gate"), "quantize": _CALIBRATED, "export": _CALIBRATED,
                    "audit": _CALIBRATED + ("eval",)}


class Pricer:
    """Prices steps without building: same keys as the executor, fingerprints of artifacts not built yet are
    placeholders ("pending:<key>"), and a step is 'build' when a target needs it and the store lacks it."""

    def __init__(self, ctx: RunContext, steps: list[Step], history: list[dict], seen: set):
        self.ctx = ctx
        self.steps = {s.name: s for s in steps}
        self.order = [s.name for s in steps]
        self.history, self.seen = history, seen
        self.keys: dict[str, str | None] = {}
        self.found: dict[str, Artifact | None] = {}
        self.loaded: dict[str, Any] = {}
        self.status: dict[str, str] = {}
        self.placeholder: set[str] = set()  # keys formed from inputs not built yet
        self.probes: dict[str, str] = {}  # key of the first artifact of steps made of many
        self._forming: list[str] = []  # steps whose keys are being formed

    @property
    def store(self) -> ArtifactStore:
        """The run's artifact store."""
        return self.ctx.store

    def has(self, name: str) -> bool:
        """Whether the run has a step called name."""
        return name in self.steps

    def key(self, name: str) -> str | None:
        """The step's cache key as the executor would form it, without building. "pending:<name>" when it needs a
        value that does not exist yet; every key formed from it is then marked a placeholder."""
        if name not in self.keys:
            self._forming.append(name)
            try:
                self.keys[name] = self.steps[name].key(self)
            except Pending:  # unknown until an input is built: the same for two runs only if their configs are
                self.keys[name] = f"pending:{name}:{self._config_digest(name)}"
                self.placeholder.add(name)
            finally:
                self._forming.pop()
        if name in self.placeholder:
            self.placeholder.update(self._forming)
        return self.keys[name]

    def _artifact(self, name: str) -> Artifact | None:
        if name not in self.found:
            step, key = self.steps[name], self.key(name)
            pending = key is None or key.startswith("pending:")
            self.found[name] = None if pending or step.source else self.store.load(step.directory, key, verify=False)
        return self.found[name]

    def fingerprint(self, name: str) -> str:
        """The step's fingerprint without building: a source step's value's; otherwise the stored artifact's, or
        "pending:<key>" when not stored (keys formed from it become placeholders), and the step is demanded."""
        step = self.steps[name]
        if step.source:
            return self.value(name).fingerprint
        art = self._artifact(name)
        self.demand(name)
        if art is None:
            self.placeholder.update(self._forming)
            return f"pending:{self.key(name)}"
        return art.fingerprint

    def value(self, name: str) -> Any:
        """Values of cheap steps that exist (model refs, token sets); Pending otherwise."""
        if name in self.loaded:
            return self.loaded[name]
        step = self.steps[name]
        if step.source:
            value = step.load(None, self, None)
        else:
            art = self._artifact(name)
            if art is None or not step.cheap:
                self.placeholder.update(self._forming)
                raise Pending(name)
            value = step.load(art, self, None)
        self.loaded[name] = value
        return value

    def demand(self, name: str) -> None:
        """The run will materialize `name`: cached, or built (and then so is what its build reads)."""
        if name in self.status:
            return
        step = self.steps[name]
        if step.probe is not None:
            self._forming.append(name)
            try:
                directory, key = step.probe(self)
            except Pending:
                directory, key = step.directory, f"pending:{name}:{self._config_digest(name)}"
                self.placeholder.add(name)
            finally:
                self._forming.pop()
            self.probes[name] = key
            if not key.startswith("pending:") and self.store.load(directory, key, verify=False) is not None:
                self.status[name] = "cached"
            else:
                self.status[name] = "shared" if (directory, key) in self.seen else "build"
                self.seen.add((directory, key))
        elif step.source:
            self.status[name] = step.source
            return
        else:
            key = self.key(name)
            if key is None:
                self.status[name] = "run"
            elif self._artifact(name) is not None:
                self.status[name] = "cached"
            else:
                self.status[name] = "shared" if (step.directory, key) in self.seen else "build"
        if self.status[name] in ("build", "run"):
            for need in step.needs:
                self.demand(need)

    def _config_digest(self, name: str) -> str:
        """A digest of the configuration sections step `name` depends on (all of them for steps not listed): what
        tells two runs' not-yet-formable keys apart."""
        import hashlib

        cfg = self.ctx.cfg
        sections = PENDING_SECTIONS.get(name)
        what = repr(cfg) if sections is None else repr([getattr(cfg, s, None) for s in sections])
        return hashlib.sha256(what.encode()).hexdigest()[:12]

    def speed(self) -> dict | None:
        """This machine's speed for the run's device and dtype (quantlab.prior; measured once per process)."""
        if not hasattr(self, "_speed"):
            self._speed = costs.machine_speed(self.store.root, self.ctx.device, self.ctx.dtype)
        return self._speed

    def price(self, target_names: list[str]) -> list[Priced]:
        """Demand the targets, then one Priced row per step in run order, with an estimate from earlier builds for
        each step to build. Steps to build are added to `seen`, so a later run of the sweep finds them 'shared'."""
        for name in target_names:
            self.demand(name)
        out = []
        for name in self.order:
            step = self.steps[name]
            key = self.probes.get(name) or self.key(name) or "-"
            status = self.status.get(name, "not needed")
            estimate = None
            if status == "build" and step.work is not None:
                try:
                    want = step.work(self)
                except Pending:  # nothing says what it reads yet (a local model that does not load)
                    want = None
                try:
                    estimate = (costs.estimate(self.history, step.directory, want, speed=self.speed()) if want
                                else costs.Estimate(None, "?"))
                except Exception:  # noqa: BLE001 - an estimate is advice: a plan never fails over one
                    estimate = costs.Estimate(None, "?")
            if status == "build" and step.probe is None:
                self.seen.add((step.directory, key))
            out.append(Priced(name, step.stage, key, status, estimate, name in self.placeholder))
        return out
