"""A newcomer's first hour, round 2 (issue 38): results that hold on another CPU, runs that never overwrite each
other, portable run directories, refusals before compute, weak evidence said, one interval per metric."""
from __future__ import annotations

import time

from conftest import FAST, cli_env, read_json, run_cli, start_module


def _show(res) -> str:
    return f"exit {res.returncode}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"


# -------------------------------------------------------------------------------- runs never overwrite each other
def test_a_second_run_into_a_held_run_dir_is_refused(tiny_llama, tmp_path):
    """Two runs into one hydra.run.dir: the second exits 2 naming the holder and writes nothing there; the first's
    final line points at its own reports."""
    cache = tmp_path / "c"
    common = [f"model.path={tiny_llama}", *FAST, "hydra.run.dir=outputs/shared"]
    first = start_module("quantlab", ["+precision=fp8", *common], tmp_path, cli_env(cache))
    holder = tmp_path / "outputs" / "shared" / ".quantlab.holder.json"
    deadline = time.time() + 300
    while not holder.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert holder.exists(), "the first run never held its directory"
    second = run_cli(["+precision=int8_sq", *common], cwd=tmp_path, cache=cache)
    assert second.returncode == 2, _show(second)
    assert "is being written by another quantlab run" in second.stderr and "precision=fp8" in second.stderr
    assert "Traceback" not in second.stderr and "hydra.run.dir" in second.stderr
    done = first.wait(600)
    assert done.returncode == 0, _show(done)
    run = tmp_path / "outputs" / "shared"
    assert read_json(run / "metrics.json")["run"]["precision"] == "fp8"
    assert read_json(run / "run.json")["run"]["precision"] == "fp8"
    assert "int8_sq" not in (run / ".hydra" / "overrides.yaml").read_text()  # refused before Hydra wrote there
    assert "fp8 kv=none" in done.stdout and "outputs/shared" in done.stdout.splitlines()[-1]
    assert not (run / ".quantlab.holder.json").exists()
    # free again: a later run into the same directory runs, and sets the earlier reports aside
    again = run_cli(["+precision=fp8", *common], cwd=tmp_path, cache=cache)
    assert again.returncode == 0, _show(again)
    assert list((run / "previous").iterdir())
