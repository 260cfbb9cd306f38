"""The Python entry point: run a configuration, plan a sweep, evaluate an existing checkpoint, with the same
config objects the CLI composes.

    from quantlab import api

    result = api.run(["+precision=fp8", "model.path=/models/my-llama"], run_dir="outputs/fp8")
    print(result.exit_code, result.metrics["ppl_ratio"]["value"], result.passed)

    for row in api.plan(["-m", "+precision=fp8,int4_awq"]):
        print(row.label, [(s.name, s.status) for s in row.steps])

    api.evaluate_checkpoint("/exports/fp8", precision="fp8", model_path="/models/my-llama")

Overrides are Hydra's (exactly what follows `python -m quantlab`); a `Config` made in Python works too.
Bad input raises QuantlabError (exit_code 2) before any compute.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from quantlab.config import Config
from quantlab.rundir import RunResult

__all__ = ["RunResult", "config", "evaluate_checkpoint", "execute", "plan", "run"]


def config(overrides: Sequence[str] = ()) -> Config:
    """The typed Config the CLI would run for these overrides (validated by Hydra's schemas)."""
    from quantlab.compose import compose

    return compose(list(overrides))[0]


def run(overrides: Sequence[str] | Config = (), run_dir: str | Path | None = None) -> RunResult:
    """Run one configuration (overrides, or a Config) into run_dir (default outputs/<time>_api)."""
    from dataclasses import asdict

    from quantlab.compose import compose

    if isinstance(overrides, Config):
        cfg, snapshot, argv = overrides, asdict(overrides), []
    else:
        argv = list(overrides)
        cfg, snapshot = compose(argv)
    run_dir = Path(run_dir) if run_dir else Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S_api")
    result = execute(cfg, run_dir.resolve(), snapshot, argv)
    result.run_dir = run_dir
    return result


def execute(cfg: Config, run_dir: Path, snapshot: dict, argv: list[str]) -> RunResult:
    """Run a composed Config into run_dir (the CLI's and run()'s one dispatch): +search=... runs the search driver
    (search.json, report.md; metrics.json per evaluation), anything else the pipeline. run_dir is held while the
    run writes it: a second run into it raises quantlab.rundir.RunDirBusy (exit 2) and writes nothing there."""
    from quantlab.rundir import claim

    with claim(run_dir, argv):
        if cfg.search is not None:
            from quantlab.search.driver import run_search

            return run_search(cfg, run_dir, snapshot, argv)
        from quantlab import preflight

        preflight.check_config(cfg)  # pure config checks before the pipeline (and torch) is imported
        from quantlab.pipeline import run_pipeline

        return run_pipeline(cfg, run_dir, snapshot, argv)


def plan(overrides: Sequence[str]):
    """The plan of a run or sweep (a list of quantlab.plan.RunPlan): per step cached / build / shared, with time
    estimates from earlier builds on this machine. Nothing is built or written."""
    from quantlab.plan import make_plan

    return make_plan(list(overrides))[0]


def evaluate_checkpoint(checkpoint: str | Path, precision: str, model_path: str | None = None, kv_cache: str = "none",
                        overrides: Sequence[str] = (), run_dir: str | Path | None = None) -> RunResult:
    """Evaluate a checkpoint exported elsewhere (hf_ptq, an earlier run) against its unquantized model."""
    args = [f"precision={precision}", f"kv_cache={kv_cache}", f"engine.checkpoint={checkpoint}"]
    if model_path:
        args.append(f"model.path={model_path}")
    return run([*args, *overrides], run_dir)
