"""A newcomer's first hour, round 2 (issue 38): results that hold on another CPU, runs that never overwrite each
other, portable run directories, refusals before compute, weak evidence said, one interval per metric."""
from __future__ import annotations

import re
import time
from pathlib import Path

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


# ------------------------------------------------------------------------------ refused before compute, with the fix
def _short_text(path: Path, paragraphs: int = 6) -> Path:
    from quantlab.stages.data import pydoc_topics

    topics = pydoc_topics()
    path.write_text("\n\n".join(topics[k].strip()[:400] for k in sorted(topics)[-paragraphs:]))
    return path


def test_a_gate_the_text_cannot_pass_is_refused_before_calibration_and_the_fix_works(tiny_llama, tmp_path):
    """A short eval text (a few windows) under the default tail checks: exit 2 before any calibration, naming the
    exact overrides; the first of them, typed as shown, lets the same run go on."""
    text = _short_text(tmp_path / "short.txt")
    fast = [a for a in FAST if not a.startswith("~gate.") and not a.startswith("eval.max_windows")]
    args = ["+precision=fp8", f"model.path={tiny_llama}", f"eval.path={text}", *fast]
    cache = tmp_path / "c"
    res = run_cli(args, cwd=tmp_path, cache=cache)
    assert res.returncode == 2, _show(res)
    err = res.stderr
    runs = [d.name for d in (tmp_path / "outputs").iterdir()]  # refused in the run: not named like a run
    assert runs and all(name.endswith("_refused") for name in runs), runs
    assert read_json(tmp_path / "outputs" / runs[0] / "run.json")["exit_code"] == 2
    assert "can never pass with" in err and "the evaluation text gives" in err and "Traceback" not in err
    assert "calibrating" not in res.stdout + err and not (cache / "quantize").exists()  # before calibration
    assert "eval.max_windows=" not in err  # the cap is not what limits it: the text is short
    drop = re.search(r"drop them: ((?:~\S+ ?)+)", err)
    assert drop, err
    assert "~gate.thresholds.kl_tail" in drop.group(1) and "eval.path=FILE giving at least" in err
    again = run_cli([*args, *drop.group(1).split()], cwd=tmp_path, cache=cache)
    assert again.returncode in (0, 1), _show(again)
    assert "weak evidence" in again.stdout.splitlines()[-1]  # a handful of windows is said where it is read


def test_weak_evidence_is_in_the_verdict_box_and_the_exit_line(tiny_llama, tmp_path):
    """PASS on 8 windows and 256 calibration tokens: a warning for each in metrics.json gate.evidence, report.md's
    verdict section (before the details) and the final line."""
    res = run_cli(["+precision=fp8", f"model.path={tiny_llama}", *FAST, "hydra.run.dir=outputs/w"], cwd=tmp_path,
                  cache=tmp_path / "c")
    assert res.returncode == 0, _show(res)
    last = res.stdout.strip().splitlines()[-1]
    assert "PASS on weak evidence" in last and "blind share" in last and "calibration tokens" in last
    doc = read_json(tmp_path / "outputs" / "w" / "metrics.json")
    evidence = doc["gate"]["evidence"]
    assert any("blind share" in e for e in evidence) and any("calibration tokens" in e for e in evidence)
    assert all(e in doc["gate"]["warnings"] for e in evidence)
    md = (tmp_path / "outputs" / "w" / "report.md").read_text()
    assert md.index("blind share") < md.index("### Metrics")


# ----------------------------------------------------------------------------------------- one interval per metric
def test_one_interval_per_metric_the_gates(tiny_llama, tmp_path):
    """The metrics table shows, for a gated metric, the interval its gate check decided with (documents as
    clusters), in the console and in both reports; ppl_ratio's MDE is a ratio, not nats."""
    res = run_cli(["+precision=fp8", f"model.path={tiny_llama}", *FAST, "hydra.run.dir=outputs/i"], cwd=tmp_path,
                  cache=tmp_path / "c")
    assert res.returncode == 0, _show(res)
    run = tmp_path / "outputs" / "i"
    doc = read_json(run / "metrics.json")
    from quantlab.report.documents import fmt

    for c in doc["gate"]["checks"]:
        if c["kind"] != "threshold" or c["metric"] not in ("top1_agreement", "ppl_ratio", "kl_mean"):
            continue
        m = doc["metrics"][c["metric"]]
        assert m["interval"] == c["ci"] and "gate" in m["interval_basis"]
        shown = f"[{fmt(c['ci'][0])}, {fmt(c['ci'][1])}]"
        table = res.stdout[: res.stdout.index("gate: alpha")]
        assert re.search(rf"^{c['metric']}\s+\S+\s+{re.escape(shown)}", table, re.M), table
        assert f"{fmt(c['ci'][0])} – {fmt(c['ci'][1])}" in (run / "report.md").read_text()
        if c["metric"] == "ppl_ratio":
            assert c["mde_unit"] == "ratio" and 0 < c["mde"] < 0.5
    # a metric no check gates keeps a 95% interval over documents
    assert doc["metrics"]["ppl_reference"]["interval_basis"] == "95%, documents as clusters"


# ------------------------------------------------------------------------------------ portable run directories
def test_a_single_file_checkpoint_is_placed_as_a_directory_holding_it(tmp_path):
    """engine.checkpoint=FILE.gguf: the run directory gets checkpoint/FILE.gguf (a hard link or a copy, never a
    link into the source), under every mode but symlink; a directory is placed file for file."""
    import os

    from quantlab.rundir import place_checkpoint

    src = tmp_path / "src" / "model.Q8_0.gguf"
    src.parent.mkdir()
    src.write_bytes(b"GGUF" + bytes(range(256)))
    for mode in ("hardlink", "copy"):
        run = tmp_path / f"run_{mode}"
        run.mkdir()
        did = place_checkpoint(run / "checkpoint", src, mode)
        placed = run / "checkpoint" / src.name
        assert (run / "checkpoint").is_dir() and not (run / "checkpoint").is_symlink()
        assert placed.read_bytes() == src.read_bytes() and not placed.is_symlink()
        assert did == mode and (os.path.samefile(placed, src) == (mode == "hardlink"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    place_checkpoint(tmp_path / "run_copy" / "checkpoint", folder, "copy")  # replaces what was there
    assert sorted(p.name for p in (tmp_path / "run_copy" / "checkpoint").iterdir()) == ["config.json"]


def test_the_checkpoint_is_inside_the_run_dir_and_the_audit_finds_its_reference(tiny_llama, tmp_path):
    """RUN/checkpoint is a directory of files (hard links into the cache: no extra disk), not a link; a copied run
    directory still holds it after the cache is gone; quantlab.audit RUN/checkpoint finds the run's reference."""
    import os
    import shutil

    cache = tmp_path / "c"
    res = run_cli(["+precision=fp8", f"model.path={tiny_llama}", *FAST, "hydra.run.dir=outputs/p",
                   "stop_after=export"], cwd=tmp_path, cache=cache)
    assert res.returncode == 0, _show(res)
    ckpt = tmp_path / "outputs" / "p" / "checkpoint"
    assert ckpt.is_dir() and not ckpt.is_symlink()
    weights = next(ckpt.glob("*.safetensors"))
    assert weights.stat().st_nlink == 2  # one inode with the cache's copy
    assert read_json(tmp_path / "outputs" / "p" / "run.json")["checkpoint"]["placed"] == "hardlink"
    audit = run_module_audit(ckpt, tmp_path)
    assert audit.returncode == 0 and "checkpoint and reference from the run" in audit.stdout, _show(audit)
    copy = tmp_path / "artifact"
    shutil.copytree(tmp_path / "outputs" / "p", copy)
    shutil.rmtree(cache)
    assert (copy / "checkpoint" / "config.json").is_file() and os.path.getsize(copy / "checkpoint" / weights.name)
    bad = run_cli(["+precision=fp8", f"model.path={tiny_llama}", *FAST, "run_checkpoint=link"], cwd=tmp_path,
                  cache=cache)
    assert bad.returncode == 2 and "run_checkpoint" in bad.stderr and "hardlink" in bad.stderr, _show(bad)
    assert not (cache / "quantize").exists()


def run_module_audit(ckpt: Path, cwd: Path):
    from conftest import run_module

    return run_module("quantlab.audit", [str(ckpt), "--no-canary"], cwd, cli_env())


# ------------------------------------------------------------------------------------- results that hold on any CPU
ISA_SETTINGS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
                "baseline x86-64": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}


def test_fragile_decisions_hold_under_two_instruction_sets(tiny_llama, tok_dir, tmp_path):
    """What made the suite red on another CPU, under two other instruction sets on this one: the test model is
    the same to the byte (it was 10-40% apart when trained in float32 at the machine's own ISA), and the search's
    tightest decision - uniform fp8 under a mean-KL bar of 9e-4 - is the same verdict with the same printed
    figures."""
    from _builders import pinned

    for mkl in ("AVX2", "SSE4_2"):  # the builder pins ATen's kernels; what another CPU still changes is MKL's
        rebuilt = pinned("model", tmp_path / f"llama_{mkl}", "llama", tok_dir,
                         env_extra={"MKL_ENABLE_INSTRUCTIONS": mkl})
        assert (rebuilt / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()
    lines = {}
    for label, env in ISA_SETTINGS.items():
        res = run_cli(["+precision=fp8", f"model.path={tiny_llama}", *FAST, "gate.thresholds.top1_agreement.min=0.9",
                       "gate.thresholds.kl_mean.max=0.0009", f"hydra.run.dir=outputs/{label.split()[0]}"],
                      cwd=tmp_path, cache=tmp_path / f"c_{label.split()[0]}", env_extra=env)
        assert res.returncode == 0, _show(res)
        lines[label] = re.sub(r" in [\d.]+ s -> .*$", "", res.stdout.strip().splitlines()[-1])
    assert len(set(lines.values())) == 1, lines
    assert "PASS" in lines["avx2"] and "machine-dependent" not in lines["avx2"]


# ------------------------------------------------------------------------------------ a warm rerun says each reuse once
def test_a_warm_rerun_names_each_reused_artifact_once(tiny_llama, tmp_path):
    """The sequential gate reads its earlier blocks again at every look: each artifact's "reusing" line appears
    once, not once per look (the square of the looks)."""
    cache = tmp_path / "c"
    args = ["+precision=fp8", f"model.path={tiny_llama}", *FAST, "eval.max_windows=12",
            "gate.statistical.look_windows=4"]
    first = run_cli(args, cwd=tmp_path, cache=cache)
    assert first.returncode in (0, 1), _show(first)
    again = run_cli(args, cwd=tmp_path, cache=cache)
    assert again.returncode == first.returncode, _show(again)
    lines = [ln.split("reusing ", 1)[1].strip() for ln in (again.stdout + again.stderr).splitlines()
             if ": reusing " in ln]
    assert lines and len(lines) == len(set(lines)), lines
    assert sum("/evaluate/" in p for p in lines) >= 2  # several looks' blocks were read back


# ------------------------------------------------------------------------ a refused rerun moves no good report aside
def test_a_bad_config_rerun_leaves_the_good_run_in_place(tiny_llama, tmp_path):
    """A run into a static run dir that passed, then the same dir with a bad value: exit 2 before anything there is
    moved or written - the good run's reports stay where they were, nothing is set aside."""
    cache = tmp_path / "c"
    common = [f"model.path={tiny_llama}", *FAST, "hydra.run.dir=outputs/keep"]
    good = run_cli(["+precision=fp8", *common], cwd=tmp_path, cache=cache)
    assert good.returncode == 0, _show(good)
    run = tmp_path / "outputs" / "keep"

    def files():
        return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()
                and "checkpoint" not in p.parts}

    before = files()
    assert "status.json" in before and ".hydra/overrides.yaml" in before
    bad = run_cli(["+precision=fp8", *common, "eval.prefix_token=cls"], cwd=tmp_path, cache=cache)
    assert bad.returncode == 2 and "prefix_token" in bad.stderr, _show(bad)
    assert not (run / "previous").exists()
    assert files() == before  # not status.json, not Hydra's .hydra/ files, not the log: the good run's own


def test_a_bad_config_makes_no_run_directory(tiny_llama, tmp_path):
    """A value the config checks refuse, with Hydra's default (timestamped) run dir: exit 2, and outputs/ holds
    nothing that looks like a run."""
    bad = run_cli(["+precision=fp8", f"model.path={tiny_llama}", *FAST, "eval.prefix_token=cls"], cwd=tmp_path,
                  cache=tmp_path / "c")
    assert bad.returncode == 2 and "prefix_token" in bad.stderr and "Traceback" not in bad.stderr, _show(bad)
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").iterdir())


# ------------------------------------------------------------------------------------------- plan against actual
def test_run_json_records_the_plan_beside_what_each_step_took(tiny_llama, tmp_path):
    """A second precision after a first: every step it builds has the seconds predicted as it started (from the
    first's cost records) beside the seconds it took; cached steps are not in the plan."""
    cache = tmp_path / "c"
    common = [f"model.path={tiny_llama}", *FAST]
    first = run_cli(["+precision=fp8", *common, "hydra.run.dir=outputs/a"], cwd=tmp_path, cache=cache)
    assert first.returncode in (0, 1), _show(first)
    second = run_cli(["+precision=int8_sq", *common, "hydra.run.dir=outputs/b"], cwd=tmp_path, cache=cache)
    assert second.returncode in (0, 1), _show(second)
    plan = read_json(tmp_path / "outputs" / "b" / "run.json")["plan"]
    steps = plan["steps"]
    assert "quantize" in steps and "prepare" not in steps and "reference" not in steps  # shared: cached
    for name in ("quantize", "export"):
        row = steps[name]
        assert row["planned_s"] and row["planned_s"] > 0 and row["actual_s"] > 0, row
        assert abs(row["error"] - (row["actual_s"] / row["planned_s"] - 1)) < 1e-2
    assert plan["planned_s"] > 0 and plan["actual_s"] > 0
    first_plan = read_json(tmp_path / "outputs" / "a" / "run.json")["plan"]
    assert {"quantize", "export"} <= set(first_plan["steps"])  # the first run built them
    assert all(row["basis"] for row in first_plan["steps"].values())  # every prediction says what it came from
    from quantlab import prior

    speed = first_plan["machine_speed"]
    for name in ("quantize", "export", "audit", "evaluate:torch"):  # an empty cache: priced from the model's shape
        row = first_plan["steps"][name]
        assert row["planned_s"] and row["planned_s"] > 0 and "a-priori" in row["basis"], (name, row)
        # what it was priced from is recorded: the figure comes back from run.json alone (a plan can be refitted)
        parts = [row["priced"]] + ([row["priced_reference"]] if "priced_reference" in row else [])
        stages = [name.split(":")[0]] + ["reference"] * (len(parts) - 1)
        again = sum(prior.seconds(stage, p["units"], p["device"].split(":")[0], speed, variant=p["variant"] or "")
                    for stage, p in zip(stages, parts, strict=True))
        assert abs(again - row["planned_s"]) <= 0.01 + 1e-3 * row["planned_s"], (name, row, again)


# ------------------------------------------------------------------------------- the cheapest refusal comes first
def test_a_missing_model_path_is_refused_before_torch_is_imported(tmp_path):
    """A model.path that does not exist: exit 2 naming it, and torch is never imported (it costs seconds, 30 under
    load): the refusal needs only the file system."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "quantlab", "+precision=fp8",
                          f"model.path={tmp_path / 'nowhere'}"], cwd=tmp_path, env=cli_env(tmp_path / "c"),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "does not exist" in res.stderr, _show(res)
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert "quantlab" in imported and "torch" not in imported and "transformers" not in imported
