"""The plan of a sweep, printed before it starts: the runs, which artifacts the cache already holds, and how
long the rest should take, predicted from the cost records of earlier builds on this machine.

    python -m quantlab -m +precision=fp8,int8_sq,int4_awq          # plan, then the sweep
    python -m quantlab --plan -m +precision=fp8,int8_sq,int4_awq   # plan only (exit 2 if a run has bad input)

Nothing is built or written here: keys are computed exactly as the pipeline computes them; where an input is
not built yet, the key is a placeholder and everything downstream of it is to be built.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

from quantlab import costs
from quantlab.artifacts import ArtifactStore
from quantlab.errors import EXIT_BAD_INPUT, EXIT_OK, QuantlabError
from quantlab.graph import Priced
from quantlab.step import Pending

log = logging.getLogger("quantlab")

COLUMNS = ("prepare", "data:calib", "data:eval", "quantize", "export", "reference", "evaluate")


@dataclass
class RunPlan:
    """One run of a plan: its label, its priced steps, or the error that would reject it."""
    label: str
    steps: list[Priced] = field(default_factory=list)
    error: str | None = None

    def seconds(self) -> float:
        """Estimated seconds of the steps this run builds (those with an estimate)."""
        return sum(s.estimate.seconds for s in self.steps if s.status == "build" and s.estimate and s.estimate.known)


# ------------------------------------------------------------------------------------------- jobs
def expand(args: list[str]) -> list[list[str]]:
    """The override list of every job, in the order Hydra's basic sweeper launches them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    task = [a for a in args if not a.startswith("-") and not a.lstrip("+~").startswith("hydra")]
    parsed = OverridesParser.create().parse_overrides(task)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _labels(jobs: list[list[str]]) -> list[str]:
    """Each job named by the overrides that differ between jobs (all of them for a single run)."""
    varying = {i for i in range(len(jobs[0])) if len({job[i] for job in jobs}) > 1} if len(jobs) > 1 else None
    out = []
    for job in jobs:
        shown = [o for i, o in enumerate(job) if varying is None or i in varying]
        out.append(" ".join(shown) or "(defaults)")
    return out


# ------------------------------------------------------------------------------------------- one run
def plan_run(cfg, label: str, history: list[dict], seen: set) -> RunPlan:
    """Price the run's steps (quantlab.graph) exactly as the pipeline would execute them."""
    from quantlab import preflight
    from quantlab.graph import Pricer, steps_for, targets
    from quantlab.pipeline import context

    ctx = context(cfg)
    steps = steps_for(ctx)
    pricer = Pricer(ctx, steps, history, seen)
    try:
        preflight.check_inputs(pricer)  # an impossible block size is this run's error
    except Pending:
        pass
    return RunPlan(label, pricer.price(targets(steps)))


def _column(step: Priced) -> str:
    return step.name if step.name in COLUMNS else step.stage


# ------------------------------------------------------------------------------------------- output
def _cell(steps: list[Priced]) -> str:
    if not steps:
        return "-"
    if len(steps) > 1:  # attribution: several evaluations
        todo = [s for s in steps if s.status == "build"]
        if not todo:
            return steps[0].status if len({s.status for s in steps}) == 1 else "cached"
        secs = [s.estimate.seconds for s in todo if s.estimate and s.estimate.known]
        guess = f" ~{_fmt(sum(secs))}" if len(secs) == len(todo) else " ?"
        return f"build {len(todo)}x{guess}"
    s = steps[0]
    if s.status != "build":
        return s.status
    if not (s.estimate and s.estimate.known):
        return "build ?"
    return f"build ~{_fmt(s.estimate.seconds)}{'*' if s.estimate.rough else ''}"


def _fmt(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s" if seconds >= 1 else f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}min"


def render(plans: list[RunPlan], store: ArtifactStore, device_label: str) -> str:
    """The plan as the table printed before a sweep (one row per run, one column per stage, the totals)."""
    head = ["run"] + [c.replace("data:", "") for c in COLUMNS] + ["estimate"]
    rows = []
    for p in plans:
        if p.error:
            rows.append([p.label, f"error: {p.error}"])
            continue
        cells = [_cell([s for s in p.steps if _column(s) == c]) for c in COLUMNS]
        unknown = any(s.status == "build" and not (s.estimate and s.estimate.known) for s in p.steps)
        todo = any(s.status == "build" for s in p.steps)
        total = (("~" + _fmt(p.seconds()) + (" + ?" if unknown else "")) if todo and p.seconds()
                 else ("?" if todo else "0s"))
        rows.append([p.label] + cells + [total])
    widths = [max(len(r[i]) for r in [head] + [r for r in rows if len(r) == len(head)]) for i in range(len(head))]
    lines = [f"quantlab plan: {len(plans)} run{'s' if len(plans) != 1 else ''}; cache {store.root}; "
             f"estimates from earlier builds on this machine ({costs.machine_id()}, {device_label}) or a-priori",
             "  " + "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    for r in rows:
        lines.append("  " + ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) if len(r) == len(head)
                             else "  ".join(r)))
    steps = [s for p in plans for s in p.steps]
    todo = [s for s in steps if s.status == "build"]
    known = [s for s in todo if s.estimate and s.estimate.known]
    reused = sum(s.status in ("cached", "shared") for s in steps)
    no_history = len(todo) - len(known)
    total = sum(s.estimate.seconds for s in known)
    summary = f"  to build: {len(todo)} artifact{'s' if len(todo) != 1 else ''}"
    if known:
        summary += f", about {_fmt(total)} run one after another"
    if no_history:
        summary += f" ({no_history} with no earlier build on this machine to predict from, not counted)"
    summary += f"; reused: {reused} (cache or an earlier run of this sweep)"
    lines.append(summary)
    if any(s.estimate and s.estimate.rough and not s.estimate.apriori for s in todo):
        lines.append("  * predicted from other precisions, engines or models on this machine (calibration through "
                     "each precision's cost model, quantlab/costs.py): rough until this variant has a build of its own")
    if any(s.estimate and s.estimate.apriori for s in todo):
        lines.append("  * a-priori: no earlier build on this machine, priced from the model's shape (layers, hidden, "
                     "vocabulary, parameters), its tokens and this machine's measured speed (quantlab/prior.py)")
    busy = costs.busy_now() if todo and device_label.startswith("cpu") else None
    if busy:
        lines.append(f"  * this machine is busy now (load average {busy[0]:.1f} on {busy[1]} CPUs): the figures are "
                     "for an idle machine, and builds sharing the CPU take longer")
    for s in todo:
        if s.estimate and s.estimate.known:
            log.debug("plan: %s %s: %.1f s from %s", s.stage, s.key, s.estimate.seconds, s.estimate.basis)
    return "\n".join(lines)


def make_plan(args: list[str]) -> tuple[list[RunPlan], str, ArtifactStore]:
    """Compose every job's config as Hydra will, then plan it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from quantlab.compose import normalize, register_configs
    from quantlab.config import conf_dir
    from quantlab.env import resolve_device

    register_configs()
    jobs = expand(normalize(args))
    labels = _labels(jobs)
    plans, seen, store, history = [], set(), None, []
    device_label = ""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for job, label in zip(jobs, labels, strict=True):
            try:
                cfg = OmegaConf.to_object(compose(config_name="config", overrides=job))
                if store is None:
                    store = ArtifactStore(cfg.cache_dir)
                    history = costs.history(store)
                    device_label = costs.device_label(resolve_device(cfg.model.device))
                plans.append(plan_run(cfg, label, history, seen))
            except QuantlabError as exc:
                plans.append(RunPlan(label, error=str(exc).splitlines()[0]))
    if store is None:
        store = ArtifactStore()
    return plans, device_label, store


def print_plan(args: list[str], strict: bool) -> int:
    """Print the plan. strict (--plan): errors are the exit code; otherwise a plan that cannot be made is
    reported in one line and the sweep goes ahead (the run itself reports bad input properly)."""
    try:
        plans, device_label, store = make_plan(args)
    except QuantlabError as exc:
        print(f"quantlab: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - the plan is advice; never block a sweep on it
        if strict:
            print(f"quantlab: error: cannot plan this sweep: {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"quantlab plan: not available ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        return EXIT_OK
    print(render(plans, store, device_label), flush=True)
    return EXIT_BAD_INPUT if any(p.error for p in plans) else EXIT_OK
