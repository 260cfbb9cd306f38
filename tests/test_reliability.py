"""Faults real users produce: SIGKILL mid-run, concurrent sweeps on one cache, a tampered cache, bad places."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import FAST, cli_env, read_json, run_cli, start_module

from quantlab.errors import QuantlabError

SLOWER = ["calib.num_samples=24", "calib.seq_len=128", "calib.batch_size=1", "eval.max_windows=12", "eval.batch_size=1"]


def _args(model, extra=()):
    fast = [a for a in FAST if a.split("=")[0] not in {b.split("=")[0] for b in SLOWER}]
    return ["+precision=int4_awq", f"model.path={model}", *fast, *SLOWER, *extra]


def _kill_when(args, marker: str, cwd, cache) -> bool:
    """Start the CLI, SIGKILL it when `marker` appears in its log; True if it was killed mid-run."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "QUANTLAB_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "quantlab", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    for line in proc.stdout:
        if marker in line:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        if time.time() > deadline:
            break
    proc.wait()
    return False


@pytest.mark.parametrize("marker,finished", [
    pytest.param("calibration batch 6/24", set(), marks=pytest.mark.slow),  # the default tier kills one stage
    ("export: writing", {"quantize"}),
    pytest.param("torch windows 1-4 of 12", {"quantize", "export"}, marks=pytest.mark.slow),
])
def test_sigkill_then_rerun_completes_and_reuses(marker, finished, tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    assert _kill_when(_args(tiny_llama), marker, tmp_path, cache), f"never saw {marker!r}"
    # nothing half-written is visible as an artifact: every entry has its manifest and matching files
    for manifest in cache.glob("*/*/manifest.json"):
        doc = json.loads(manifest.read_text())
        assert all((manifest.parent / f).is_file() for f in doc["files"])
    res = run_cli(_args(tiny_llama), cwd=tmp_path, cache=cache)
    assert res.returncode in (0, 1), res.stderr[-3000:]
    run = sorted(p for p in (tmp_path / "outputs").iterdir() if (p / "metrics.json").is_file())[-1]
    events = {(e["stage"], e["action"]) for e in read_json(run / "run.json")["events"]}
    for stage in finished:
        assert (stage, "built") not in events, (stage, events)
    if "quantize" in finished:
        assert "calibration batch" not in res.stderr + res.stdout
    if "windows" in marker:  # the evaluated block was stored before the kill and is read back
        assert ("evaluate", "reused") in events, events


def test_two_sweeps_share_one_cache(tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    procs = []
    for i in range(2):
        (tmp_path / f"s{i}").mkdir()
        procs.append(start_module("quantlab", ["-m", "+precision=fp8,int8_sq", f"model.path={tiny_llama}", *FAST],
                                  tmp_path / f"s{i}", cli_env(cache)))
    done = [p.wait(600) for p in procs]
    assert all(d.returncode in (0, 1) for d in done), [(d.returncode, d.stderr[-2000:]) for d in done]
    built: dict = {}
    metrics: dict = {}
    for i in range(2):
        for run in (tmp_path / f"s{i}" / "outputs").glob("sweep_*/*/run.json"):
            for e in read_json(run)["events"]:
                if e["action"] == "built":
                    built[(e["stage"], e["key"])] = built.get((e["stage"], e["key"]), 0) + 1
            doc = read_json(run.parent / "metrics.json")
            metrics.setdefault(doc["run"]["precision"], []).append(doc["metrics"])
    assert built and all(n == 1 for n in built.values()), built
    assert len(list(cache.glob("export/*/manifest.json"))) == 2
    for precision, pair in metrics.items():
        assert len(pair) == 2 and pair[0] == pair[1], precision


def test_tampered_cache_entry_is_detected_and_rebuilt(tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    args = ["+precision=fp8", f"model.path={tiny_llama}", "stop_after=export", *FAST]
    assert run_cli(args, cwd=tmp_path, cache=cache).returncode == 0
    weights = next(cache.glob("export/*/model.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # same size, one flipped byte
    weights.write_bytes(bytes(data))
    res = run_cli(args, cwd=tmp_path, cache=cache)
    assert res.returncode == 0
    log = res.stdout + res.stderr
    assert "is damaged" in log and "model.safetensors" in log
    record = read_json(sorted((tmp_path / "outputs").iterdir())[-1] / "run.json")
    assert ("export", "built") in {(e["stage"], e["action"]) for e in record["events"]}


def test_cache_list_and_prune(tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    run_cli(["+precision=fp8", f"model.path={tiny_llama}", "stop_after=export", *FAST], cwd=tmp_path, cache=cache)
    ls = subprocess.run([sys.executable, "-m", "quantlab.cache", "list", "--cache-dir", str(cache)],
                        capture_output=True, text=True)
    assert ls.returncode == 0 and "export" in ls.stdout and "FP8" in ls.stdout
    prune = subprocess.run([sys.executable, "-m", "quantlab.cache", "prune", "--stage", "export", "--all",
                            "--cache-dir", str(cache)], capture_output=True, text=True)
    assert prune.returncode == 0 and "removed 1" in prune.stdout
    assert not list(cache.glob("export/*/manifest.json")) and list(cache.glob("quantize/*/manifest.json"))


def test_unwritable_output_directory_is_exit_2(tmp_path, tiny_llama):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    res = run_cli(["+precision=fp8", f"model.path={tiny_llama}", f"hydra.run.dir={blocker}/run"], cwd=tmp_path)
    assert res.returncode == 2 and "cannot be created" in res.stderr and "Traceback" not in res.stderr


def test_fp8_on_a_pre_ada_gpu_is_refused_with_the_reason():
    from conftest import compose

    from quantlab import preflight
    from quantlab.env import Device

    cfg, _ = compose(["+precision=fp8"])
    a100 = Device("cuda", 0, "NVIDIA A100-SXM4-80GB", (8, 0))
    with pytest.raises(QuantlabError, match=r"compute capability >= 8.9 .* A100-SXM4-80GB has 8.0") as err:
        preflight.check_device(cfg, a100)
    assert "int8_sq, int4_awq" in err.value.fix and "fp8" not in err.value.fix.split("(")[1].split(")")[0]
    cfg, _ = compose(["+precision=int8_sq", "kv_cache=fp8"])
    with pytest.raises(QuantlabError, match="fp8 kv cache") as err:
        preflight.check_device(cfg, a100)
    assert "kv_cache=none" in err.value.fix
    h200 = Device("cuda", 0, "NVIDIA H200", (9, 0))  # NVFP4 needs Blackwell: the fix offers what Hopper runs
    cfg, _ = compose(["+precision=nvfp4"])
    with pytest.raises(QuantlabError, match="nvfp4 needs compute capability >= 10.0") as err:
        preflight.check_device(cfg, h200)
    assert "fp8" in err.value.fix and "nvfp4" not in err.value.fix and "kv_cache" not in err.value.fix
    cfg, _ = compose(["+precision=int8_sq"])
    preflight.check_device(cfg, a100)  # INT8 SmoothQuant runs there
