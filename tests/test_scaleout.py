"""Parallel and cluster-style sweeps through Hydra launchers (real processes, one shared cache)."""
from __future__ import annotations

import importlib.util

import pytest
from conftest import FAST, read_json, run_cli

PRECISIONS = "+precision=fp8,int8_sq"


def _sweep(tmp_path, name, tiny_llama, cache, launcher_args):
    cwd = tmp_path / name
    cwd.mkdir()
    res = run_cli(["-m", PRECISIONS, f"model.path={tiny_llama}", *FAST, *launcher_args], cwd=cwd, cache=cache)
    runs = sorted(cwd.glob("outputs/sweep_*/*/metrics.json"))
    metrics = {read_json(r)["run"]["precision"]: read_json(r)["metrics"] for r in runs}
    built = [(e["stage"], e["key"]) for r in runs for e in read_json(r.parent / "run.json")["events"] if e["action"] == "built"]
    return res, metrics, built, cwd


@pytest.mark.parametrize("launcher", [
    pytest.param(["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], id="joblib",
                 marks=pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None,
                                          reason="hydra-joblib-launcher not installed")),
    pytest.param(["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"], id="submitit_local",
                 marks=pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                                          reason="hydra-submitit-launcher not installed")),
])
def test_launcher_sweep_matches_sequential(launcher, tiny_llama, tmp_path):
    seq_res, seq_metrics, _, _ = _sweep(tmp_path, "sequential", tiny_llama, tmp_path / "cache_seq", [])
    res, metrics, built, cwd = _sweep(tmp_path, "parallel", tiny_llama, tmp_path / "cache_par", launcher)
    assert res.returncode == seq_res.returncode, res.stderr[-3000:]
    assert set(metrics) == {"fp8", "int8_sq"}
    for precision in metrics:
        assert metrics[precision] == seq_metrics[precision], precision
    assert len(built) == len(set(built)), "a shared artifact was built twice"
    assert next(cwd.glob("outputs/sweep_*/summary.html")).is_file()


def test_sweep_exit_code_comes_from_every_job(tiny_llama, tmp_path):
    """A job failing its gate in another process still fails the sweep (exit 1)."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    res = run_cli(["-m", PRECISIONS, f"model.path={tiny_llama}", *FAST, "gate.thresholds.top1_agreement.min=0.9999",
                   "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], cwd=tmp_path, cache=tmp_path / "cache")
    assert res.returncode == 1, res.stderr[-2000:]
