"""audit_errors=evaluate (issue 39's timing runs on random weights, and diagnosis of a broken export): an audit error
no longer ends the run before evaluation; the run is evaluated and its verdict is FAIL whatever the gate says, with the
audit's error first among the warnings. The default (stop) and a bad value behave as before."""
from __future__ import annotations

import shutil

from conftest import FAST, read_json, run_api, run_cli
from safetensors.torch import load_file, save_file


def _show(res) -> str:
    return f"exit {res.returncode}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"


def _broken_export(model_dir, tmp_path, cache):
    """A real FP8 export of the tiny model with one down_proj's input_scale 10x too small: its outliers clip (an
    audit error of the activations check); the engine still loads it."""
    run_api(["+precision=fp8", f"model.path={model_dir}", f"cache_dir={cache}", "stop_after=export", *FAST],
            tmp_path / "export_run")
    dst = tmp_path / "broken"
    shutil.copytree((tmp_path / "export_run" / "checkpoint").resolve(), dst)
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    name = next(n for n in sorted(tensors) if n.endswith("mlp.down_proj.input_scale"))
    tensors[name] = tensors[name] / 10
    save_file(tensors, str(path), metadata={"format": "pt"})
    return dst


def test_an_audit_error_is_evaluated_on_request_and_never_passes(tiny_llama, tmp_path):
    cache = tmp_path / "c"
    ckpt = _broken_export(tiny_llama, tmp_path, cache)
    common = ["+precision=fp8", f"model.path={tiny_llama}", f"engine.checkpoint={ckpt}", *FAST]
    stopped = run_cli([*common, "hydra.run.dir=outputs/stop"], cwd=tmp_path, cache=cache)
    assert stopped.returncode == 1 and "nothing was evaluated" in stopped.stdout, _show(stopped)
    assert not (tmp_path / "outputs" / "stop" / "metrics.json").exists()
    went_on = run_cli([*common, "audit_errors=evaluate", "hydra.run.dir=outputs/eval"], cwd=tmp_path, cache=cache)
    assert went_on.returncode == 1, _show(went_on)
    doc = read_json(tmp_path / "outputs" / "eval" / "metrics.json")
    assert doc["gate"]["passed"] is False and doc["gate"]["warnings"][0].startswith("the checkpoint audit found")
    assert "[activations]" in doc["gate"]["audit_failed"] and doc["run"]["audit"]["passed"] is False
    assert "FAIL" in went_on.stdout.strip().splitlines()[-1]
    md = (tmp_path / "outputs" / "eval" / "report.md").read_text()
    assert "❌ FAIL" in md and "Checkpoint audit: FAILED" in md


def test_a_bad_audit_errors_value_is_refused_before_compute(tiny_llama, tmp_path):
    res = run_cli(["+precision=fp8", f"model.path={tiny_llama}", "audit_errors=ignore"], cwd=tmp_path,
                  cache=tmp_path / "c")
    assert res.returncode == 2 and "audit_errors=stop" in res.stderr and "Traceback" not in res.stderr, _show(res)
