"""The sweep summary names what to ship, whatever happened to the other runs (issues 23 and 28).

Real sweeps of the tiny model: one run's checkpoint is broken (its audit stops it, nothing evaluated), another's
precision is refused before any compute (exit 2); damaged records; a model directory named like HTML. The summary
reads precision, KV cache and engine from what each run recorded, never `?`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import FAST, cli_env, read_json, run_api, run_cli, run_module

HOSTILE = "<img src=x onerror=alert(1)>"
WHAT = ("precision", "kv_cache", "engine")


def _show(res) -> str:
    return f"exit {res.returncode}\n--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}"


def _python(module, *args, cwd=None):
    return run_module(module, args, cwd or Path.cwd(), cli_env(), 900)


def _table(md: str) -> list[list[str]]:
    """The rows of summary.md's run table, cells stripped."""
    lines = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| run ")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, shared_cache, tmp_path_factory):
    """An FP8 export of the tiny model, and a copy with one weight scale zeroed in a directory named like HTML."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("summary_exports")
    assert run_api(["+precision=fp8", f"model.path={tiny_llama}", f"cache_dir={shared_cache}", "stop_after=export",
                    *FAST], out / "run") == 0
    good = (out / "run" / "checkpoint").resolve()
    export = json.loads((out / "run" / "run.json").read_text())["artifacts"]["export"]
    assert 8.0 <= export["bits_per_weight"] < 8.1 and export["quantized_layers"] > 0  # FP8 codes + per-tensor scales
    bad = out / HOSTILE
    shutil.copytree(good, bad)
    for file in sorted(bad.glob("*.safetensors")):
        tensors = load_file(str(file))
        name = next((n for n in sorted(tensors) if n.endswith(".weight_scale")), None)
        if name:
            tensors[name] = tensors[name] * 0
            save_file(tensors, str(file), metadata={"format": "pt"})
            break
    return good, bad


@pytest.fixture(scope="module")
def audit_sweep(checkpoints, tiny_llama, shared_cache, tmp_path_factory):
    """A two-run sweep over two checkpoints: the healthy one passes, the broken one is stopped by its audit."""
    good, bad = checkpoints
    cwd = tmp_path_factory.mktemp("audit_sweep")
    res = run_cli(["-m", "+precision=fp8", f"model.path={tiny_llama}", f"engine.checkpoint={good},'{bad}'", *FAST,
                   "hydra.sweep.dir=outputs/sweep"], cwd=cwd, cache=shared_cache)
    assert res.returncode == 1, _show(res)  # the audit's exit 1: the sweep exits with its largest code
    return cwd / "outputs" / "sweep", res


def test_a_run_stopped_by_its_audit_is_a_row_and_the_rest_names_the_ship_candidate(audit_sweep):
    sweep, res = audit_sweep
    for name in ("summary.md", "summary.html", "summary.json"):
        assert (sweep / name).is_file(), _show(res)
    rows = json.loads((sweep / "summary.json").read_text())
    assert len(rows) == 2
    for row in rows:
        assert (row["precision"], row["kv_cache"], row["engine"]) == ("fp8", "none", "torch"), row
    stopped = next(r for r in rows if r["verdict"] == "AUDIT FAIL")
    passed = next(r for r in rows if r["verdict"] != "AUDIT FAIL")
    assert passed["verdict"] == "PASS" and passed["size_bytes"] > 0
    assert "[scales]" in stopped["reason"] and "nothing evaluated" in stopped["reason"] and stopped["stopped"]
    md = (sweep / "summary.md").read_text()
    for cells in _table(md):
        assert cells[1:4] == ["fp8", "none", "torch"], cells  # never "?"
    from quantlab.report.render import md_escape

    assert f"**Ship candidate: fp8, KV cache none, engine torch** (run {md_escape(passed['name'])})" \
        in md.replace("\\-", "-")
    assert "1 run stopped before a verdict" in md and "AUDIT FAIL" in md
    assert "ship candidate fp8, KV cache none, engine torch" in res.stdout
    html = (sweep / "summary.html").read_text()
    assert "Ship fp8, KV cache none, engine torch" in html and "AUDIT FAIL" in html


def test_no_raw_html_from_a_path_reaches_any_markdown(audit_sweep):
    """The broken checkpoint lives in a directory named <img src=x onerror=alert(1)>: its run's report.md (the
    audit's), the healthy run's report.md and summary.md hold no raw tag; HTML reports escape it."""
    sweep, _ = audit_sweep
    files = [sweep / "summary.md", *sorted(sweep.glob("*/report.md"))]
    assert len(files) == 3
    for md in files:
        assert "<img" not in md.read_text(), md
    stopped = next(p for p in sweep.glob("*/report.md") if "audit found" in p.read_text())
    assert "\\x3cimg src=x onerror=alert(1)\\x3e" in stopped.read_text()  # shown as bash reads it back
    for html in sweep.glob("*/report.html"):
        assert "<img src=x" not in html.read_text()


def test_the_audit_takes_a_run_directory(audit_sweep, tmp_path):
    sweep, _ = audit_sweep
    rows = json.loads((sweep / "summary.json").read_text())
    healthy = Path(next(r for r in rows if r["verdict"] == "PASS")["run_dir"])
    res = _python("quantlab.audit", str(healthy), "--no-canary")
    assert res.returncode == 0, _show(res)
    assert "checkpoint and reference from the run directory" in res.stdout and "PASS" in res.stdout
    broken = Path(next(r for r in rows if r["verdict"] == "AUDIT FAIL")["run_dir"])
    res = _python("quantlab.audit", str(broken), "--no-canary")
    assert res.returncode == 1 and "[scales]" in res.stdout, _show(res)
    empty = tmp_path / "run"
    empty.mkdir()
    (empty / "run.json").write_text(json.dumps({"run": {"precision": "fp8"}, "exit_code": 2,
                                                "error": "eval.seq_len=100000 is over the model's max positions"}))
    res = _python("quantlab.audit", str(empty))
    assert res.returncode == 2 and "without a checkpoint to audit" in res.stderr and "fix:" in res.stderr, _show(res)
    assert "Traceback" not in res.stderr


def test_damaged_records_are_named_and_the_rest_is_read(audit_sweep, tmp_path):
    """run.json cut in the middle, a status.json that is not an object, metrics.json not JSON: the summary names
    each file, reads what is left (a run's metrics.json still says what it ran and its verdict), exit 0."""
    sweep, _ = audit_sweep
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy, symlinks=True)
    rows = json.loads((sweep / "summary.json").read_text())
    healthy = copy / next(r for r in rows if r["verdict"] == "PASS")["name"]
    broken = copy / next(r for r in rows if r["verdict"] == "AUDIT FAIL")["name"]
    text = (healthy / "run.json").read_text()
    (healthy / "run.json").write_text(text[: len(text) // 2])
    (broken / "status.json").write_text("[1, 2]")
    res = _python("quantlab.summary", str(copy), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, _show(res)
    assert f"{healthy / 'run.json'} is damaged" in res.stderr and f"{broken / 'status.json'} is damaged" in res.stderr
    assert "Traceback" not in res.stderr
    again = json.loads((tmp_path / "out" / "summary.json").read_text())
    row = next(r for r in again if r["name"] == healthy.name)
    assert (row["precision"], row["kv_cache"], row["engine"], row["verdict"]) == ("fp8", "none", "torch", "PASS")
    assert any("run.json is damaged" in n for n in row["notes"])
    assert "⚠️" in (tmp_path / "out" / "summary.md").read_text()
    (healthy / "metrics.json").write_text("{not json")
    res = _python("quantlab.summary", str(copy), "--out", str(tmp_path / "out2"))
    assert res.returncode == 0 and "metrics.json is damaged" in res.stderr, _show(res)
    from quantlab.report.sweep import exit_codes

    assert sorted(exit_codes(copy)) == [0, 3]  # an unreadable exit code counts as a crash, and is not a traceback
    res = _python("quantlab.audit", str(healthy), "--no-canary")  # run.json damaged: the checkpoint link still works
    assert res.returncode == 0, _show(res)


def test_a_run_refused_before_compute_is_a_row_with_its_reason(family_model, tmp_path, shared_cache):
    """A sweep over fp8 and int8_sq of a Mixture-of-Experts model: int8_sq is refused at preflight (exit 2). Its row
    says so; the fp8 run is still summarized and is the ship candidate. Without its run.json (a job stopped before
    quantlab wrote anything: status.json and Hydra's record only) the row still names what it was."""
    res = run_cli(["-m", "+precision=fp8,int8_sq", f"model.path={family_model('mixtral')}", *FAST,
                   "hydra.sweep.dir=outputs/sweep"], cwd=tmp_path, cache=shared_cache)
    assert res.returncode == 2, _show(res)
    sweep = tmp_path / "outputs" / "sweep"
    rows = {r["precision"]: r for r in json.loads((sweep / "summary.json").read_text())}
    assert set(rows) == {"fp8", "int8_sq"}, _show(res)
    refused = rows["int8_sq"]
    assert refused["verdict"] == "BAD INPUT" and "fix:" in refused["reason"] and "mixtral" in refused["model"]
    assert rows["fp8"]["verdict"] in ("PASS", "FAIL") and rows["fp8"]["engine"] == "torch"
    (Path(refused["run_dir"]) / "run.json").unlink()
    res = _python("quantlab.summary", str(sweep))
    assert res.returncode == 0, _show(res)
    again = {r["precision"]: r for r in json.loads((sweep / "summary.json").read_text())}
    assert again["int8_sq"]["verdict"] == "BAD INPUT" and again["int8_sq"]["kv_cache"] == "none"
    assert read_json(Path(refused["run_dir"]) / "status.json")["exit_code"] == 2


def test_crashed_and_interrupted_runs_keep_what_they_were(tmp_path):
    """run.json is written as a run starts; a crash or Ctrl-C adds why it ended (quantlab.rundir.stopped is what the
    pipeline calls on any exception), and the summary lists both with that reason."""
    from quantlab import rundir
    from quantlab.report.sweep import summary_rows

    runs = []
    for name, exc in (("crashed", RuntimeError("boom")), ("interrupted", KeyboardInterrupt())):
        run = tmp_path / name
        run.mkdir()
        rundir.start(run, {"run": rundir.what_ran("int4_awq", "fp8", "torch", "m")})
        rundir.stopped(run, exc)
        runs.append(run)
    rows = {r["name"]: r for r in summary_rows(runs)}
    assert rows["crashed"]["verdict"] == "ERROR" and "RuntimeError: boom" in rows["crashed"]["reason"]
    assert rows["interrupted"]["verdict"] == "INTERRUPTED"
    assert all((r["precision"], r["kv_cache"]) == ("int4_awq", "fp8") for r in rows.values())
    assert read_json(runs[0] / "run.json")["exit_code"] == 3
