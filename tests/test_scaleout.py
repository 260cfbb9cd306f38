"""Parallel and cluster-style sweeps through Hydra launchers (real processes, one shared cache)."""
from __future__ import annotations

import importlib.util
import shutil
import statistics

import pytest
from conftest import FAST, read_json, run_cli

from quantlab import costs

PRECISIONS = "+precision=fp8,int8_sq"


def _sweep(tmp_path, name, tiny_llama, cache, launcher_args):
    cwd = tmp_path / name
    cwd.mkdir()
    res = run_cli(["-m", PRECISIONS, f"model.path={tiny_llama}", *FAST, *launcher_args], cwd=cwd, cache=cache)
    runs = sorted(cwd.glob("outputs/sweep_*/*/metrics.json"))
    metrics = {read_json(r)["run"]["precision"]: read_json(r)["metrics"] for r in runs}
    built = [(e["stage"], e["key"]) for r in runs for e in read_json(r.parent / "run.json")["events"]
             if e["action"] == "built"]
    return res, metrics, built, cwd


@pytest.fixture(scope="module")
def sequential(tiny_llama, tmp_path_factory):
    """The sweep without a launcher, cold cache: what every launcher's sweep must reproduce (run once)."""
    tmp = tmp_path_factory.mktemp("sequential")
    res, metrics, _, _ = _sweep(tmp, "sequential", tiny_llama, tmp / "cache_seq", [])
    return res, metrics, tmp / "cache_seq"


@pytest.mark.parametrize("launcher", [
    pytest.param(["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], id="joblib",
                 marks=pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None,
                                          reason="hydra-joblib-launcher not installed")),
    pytest.param(["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"], id="submitit_local",
                 marks=pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                                          reason="hydra-submitit-launcher not installed")),
])
def test_launcher_sweep_matches_sequential(launcher, tiny_llama, sequential, tmp_path):
    seq_res, seq_metrics, _ = sequential
    res, metrics, built, cwd = _sweep(tmp_path, "parallel", tiny_llama, tmp_path / "cache_par", launcher)
    assert res.returncode == seq_res.returncode, res.stderr[-3000:]
    assert set(metrics) == {"fp8", "int8_sq"}
    for precision in metrics:
        assert metrics[precision] == seq_metrics[precision], precision
    assert len(built) == len(set(built)), "a shared artifact was built twice"
    assert next(cwd.glob("outputs/sweep_*/summary.html")).is_file()
    assert "quantlab plan: 2 runs" in res.stdout  # launchers on this machine get the plan too


def test_sweep_exit_code_comes_from_every_job(tiny_llama, sequential, tmp_path):
    """A job failing its gate in another process still fails the sweep (exit 1). The jobs start from a copy of the
    sequential sweep's cache (their checkpoints exist; what is tested is the gate's exit code crossing processes)."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    shutil.copytree(sequential[2], tmp_path / "cache")
    res = run_cli(["-m", PRECISIONS, f"model.path={tiny_llama}", *FAST, "gate.thresholds.top1_agreement.min=0.9999",
                   "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], cwd=tmp_path, cache=tmp_path / "cache")
    assert res.returncode == 1, res.stderr[-2000:]
    assert "calibration batch" not in res.stdout + res.stderr


# ------------------------------------------------------------------------------------------- plan
def _plan_statuses(args, cache, monkeypatch):
    from quantlab.plan import make_plan

    monkeypatch.setenv("QUANTLAB_CACHE", str(cache))
    plans, _, _ = make_plan(args)
    return plans


def test_plan_predicts_what_the_sweep_builds(tiny_llama, tmp_path, monkeypatch):
    """--plan writes nothing; the printed plan before a sweep says exactly which artifacts are cached, which
    are built, and which one run builds for another; estimates come from the earlier builds' cost records."""
    cache = tmp_path / "cache"
    args = ["-m", PRECISIONS, f"model.path={tiny_llama}", *FAST]
    res = run_cli(["--plan", *args], cwd=tmp_path, cache=cache)
    assert res.returncode == 0, res.stderr[-2000:]
    # a machine's first plan: priced a-priori from the model's shape and the machine's speed (was "build ?")
    assert "quantlab plan: 2 runs" in res.stdout and "build ?" not in res.stdout and "a-priori" in res.stdout, \
        res.stdout
    assert not list(cache.glob("*/*/manifest.json")) and not (tmp_path / "outputs").exists(), "--plan wrote something"

    # one precision first: its cost records are the history the plan predicts the second from
    assert run_cli(["-m", "+precision=fp8", f"model.path={tiny_llama}", *FAST], cwd=tmp_path,
                   cache=cache).returncode == 0
    plans = _plan_statuses(args, cache, monkeypatch)
    fp8, int8 = plans
    assert {s.name: s.status for s in fp8.steps} == {"prepare": "local", "data:calib": "cached", "data:eval": "cached",
                                                       "quantize": "not needed", "export": "cached",
                                                       "audit": "cached", "reference": "not needed",
                                                       "evaluate:torch": "cached"}
    todo = {s.name: s for s in int8.steps if s.status == "build"}
    assert set(todo) == {"quantize", "export", "audit", "evaluate:torch"}
    recorded: dict[str, list[float]] = {}
    for m in cache.glob("*/*/manifest.json"):
        if "cost" in read_json(m):
            # as on an idle machine: a build that shared the CPU with other tests counts for less (costs.history)
            recorded.setdefault(read_json(m)["cost"]["stage"], []).append(costs.idle_seconds(read_json(m)["cost"]))
    from quantlab import prior

    for name, step in todo.items():  # same model and tokens, other precision: the fp8 build's time, marked rough
        stage = name.split(":")[0]
        # the evaluation is priced at the windows a passing run reads, at the blocks' measured pace: FAST's blocks
        # are looks of 4 windows and it has no tail checks, so a passing run can stop at its first look
        want = statistics.fmean(recorded[stage])
        if stage == "audit":
            assert step.estimate.seconds == pytest.approx(want), (stage, recorded[stage])
        else:  # another precision's build, scaled by the precisions' speed (quantlab.prior), diluted by fixed costs
            table = prior.PRECISION_FACTOR["cpu"].get(stage, {})
            lo, hi = sorted((1.0, table.get("int8_sq", 1.0) / table.get("fp8", 1.0)))
            # and by the work of each: the run's evaluation also reads the numerics check's look, which its
            # blocks' records did not (a-priori under the fixed seconds: < 0.1% here)
            assert want * lo * (1 - 1e-3) <= step.estimate.seconds <= want * hi * (1 + 1e-3), (stage, step.estimate)
            assert "precisions' speed" in step.estimate.basis, step.estimate.basis
        # the audit's cost depends on the model only, not on the precision: the same variant, an exact basis
        assert step.estimate.rough == (stage != "audit"), stage

    (tmp_path / "sweep").mkdir()
    res = run_cli(args, cwd=tmp_path / "sweep", cache=cache)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.index("quantlab plan: 2 runs") < res.stdout.index("quantlab: fp8"), "plan not printed first"
    for plan, run_json in zip(plans, sorted((tmp_path / "sweep").glob("outputs/sweep_*/*/run.json")), strict=False):
        events = {(e["stage"], e["key"]): e["action"] for e in read_json(run_json)["events"]}
        built_stages = [s for (s, _), action in events.items() if action == "built"]
        for step in plan.steps:
            directory = step.name.split(":")[0] if step.name != "reference" else "reference"
            if step.status == "build" and step.placeholder:  # the key depends on a checkpoint built in this run
                assert directory in built_stages, (plan.label, step)
            elif step.status == "build":
                assert events.get((directory, step.key)) == "built", (plan.label, step)
            elif step.status == "cached" and directory in ("export", "reference", "evaluate"):
                assert events.get((directory, step.key)) == "reused", (plan.label, step)
            elif step.status == "not needed":
                assert (directory, step.key) not in events, (plan.label, step)


def test_plan_reports_bad_runs(tiny_llama, tmp_path):
    """A run the sweep would reject is shown as such in the plan, and --plan exits 2 for it."""
    res = run_cli(["--plan", "-m", "+precision=int4_awq", "precision.block_size=16,48", f"model.path={tiny_llama}",
                   *FAST], cwd=tmp_path, cache=tmp_path / "cache")
    assert res.returncode == 2, res.stdout + res.stderr[-2000:]
    row16, row48 = [line for line in res.stdout.splitlines() if "precision.block_size=" in line]
    assert "build ~" in row16 and "error: AWQ block size 48 does not divide" in row48, res.stdout


def test_cost_estimates():
    from quantlab.costs import estimate, record, work

    def rec(seconds, variant="fp8", size=1000, params=10, machine=None):
        r = record("evaluate", seconds, work("cpu:x", variant, params, size))
        return {**r, "machine": machine or r["machine"]}

    assert not estimate([], "evaluate", work("cpu:x", "fp8", 10, 1000)).known
    assert not estimate([rec(5.0, machine="elsewhere")], "evaluate", work("cpu:x", "fp8", 10, 1000)).known
    one = estimate([rec(5.0)], "evaluate", work("cpu:x", "fp8", 20, 3000))  # proportional in size and params
    assert one.seconds == pytest.approx(30.0) and not one.rough
    fit = estimate([rec(3.0, size=1000), rec(5.0, size=2000), rec(9.0, size=4000)], "evaluate",
                   work("cpu:x", "fp8", 10, 8000))
    assert fit.seconds == pytest.approx(17.0) and "1.0 s fixed" in fit.basis  # 1 s + 2 s per 1000
    rough = estimate([rec(4.0, variant="int8_sq")], "evaluate", work("cpu:x", "fp8", 10, 1000))
    assert rough.seconds == pytest.approx(4.0) and rough.rough
