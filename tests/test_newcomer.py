"""A newcomer's first hour (issue 23): --help, the setup script's choice of PyTorch, the plan's cost model, and the
latency search's decision on a deterministic clock (the real timing is bench/latency_search.py's)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import FAST, REPO

from quantlab import costs
from quantlab.engines.registry import ENGINES
from quantlab.precisions import PRECISIONS

# SmolLM2-135M's shape (the default model)
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
           "num_hidden_layers": 30, "head_dim": 64}


def _show(res) -> str:
    return f"exit {res.returncode}\n--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}"


# ------------------------------------------------------------------------------------------------------- help
@pytest.mark.parametrize("args", [["--help"], ["-h"], ["-m", "+precision=fp8,int8_sq", "--help"]])
def test_help_is_quantlabs_own(args):
    res = subprocess.run([sys.executable, "-m", "quantlab", *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, _show(res)
    out = res.stdout
    assert "_schema_" not in out
    for name, p in PRECISIONS.items():
        assert name in out and (p.modelopt_cfg or name in ("mixed", "external"))  # those two quantlab never makes
    assert all(name in out for name, e in ENGINES.items() if e.public)
    assert "default, strict" in out and "smollm2_135m" in out and "pydoc" in out
    assert re.search(r"calib\.num_samples\s+32\s", out) and re.search(r"eval\.max_windows\s+160\s", out)
    assert "Exit codes" in out and re.search(r"^\s+130\s", out, re.M) and "python -m quantlab.audit outputs/RUN" in out


def test_help_for_a_precision_lists_its_keys():
    res = subprocess.run([sys.executable, "-m", "quantlab", "--help", "+precision=int4_awq"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, _show(res)
    assert "Precision int4_awq: W4A16 AWQ" in res.stdout and re.search(r"precision\.block_size\s+default auto",
                                                                         res.stdout)
    res = subprocess.run([sys.executable, "-m", "quantlab", "--help", "+precision=fp8"], capture_output=True,
                         text=True, timeout=300)
    assert "no keys of its own" in res.stdout, _show(res)


# ------------------------------------------------------------------------------------------------------ setup
def _setup(env_extra: dict, path: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_PIP_ARGS"}
    env.update(SETUP_DRY_RUN="1", PATH=path, **env_extra)
    return subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60)


def test_setup_installs_the_torch_build_that_fits_the_machine(tmp_path):
    """The decision only (SETUP_DRY_RUN=1 prints the commands): the CPU build where there is no NVIDIA GPU, the CUDA
    build where nvidia-smi lists one, TORCH_PIP_ARGS over both. A real install is timed in the report."""
    plain = "/usr/bin:/bin"
    if not list(Path("/dev").glob("nvidia[0-9]*")):
        res = _setup({}, plain)
        assert res.returncode == 0, _show(res)
        assert "no NVIDIA GPU here" in res.stdout and "install --retries 1 --timeout 20 torch==2.13.0+cpu" in res.stdout
    gpu = tmp_path / "bin"
    gpu.mkdir()
    (gpu / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    (gpu / "nvidia-smi").chmod(0o755)
    res = _setup({}, f"{gpu}:{plain}")
    assert res.returncode == 0 and "+ python -m pip install torch==2.13.0\n" in res.stdout, _show(res)
    res = _setup({"TORCH_PIP_ARGS": "torch==2.13.0 --index-url https://example.invalid/whl"}, plain)
    assert "+ python -m pip install torch==2.13.0 --index-url https://example.invalid/whl" in res.stdout, _show(res)
    assert " -q" not in res.stdout  # pip's progress is shown


# ------------------------------------------------------------------------------------------------ cost model
def test_calibration_table_matches_modelopts_presets():
    """costs.CALIBRATION (planning never imports ModelOpt) is what each precision's preset runs."""
    import modelopt.torch.quantization as mtq

    calibrated = {n for n, p in PRECISIONS.items() if p.modelopt_cfg}
    assert set(costs.CALIBRATION) == calibrated
    for name, method in costs.CALIBRATION.items():
        algo = getattr(mtq, PRECISIONS.get(name).modelopt_cfg).get("algorithm")
        assert (algo.get("method") if isinstance(algo, dict) else algo) == method, name
        if isinstance(algo, dict) and "alpha_step" in algo:
            assert costs.awq_grid(algo["alpha_step"]) == costs.awq_grid() == 11


def test_each_precision_has_its_own_calibration_cost():
    share = costs.linear_share(SMOLLM2, 512)
    linear = 576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536
    assert share == pytest.approx(linear / (linear + 2 * 9 * 64 * 256))
    assert costs.precision_passes("fp8", SMOLLM2, 512) == 1.0
    assert costs.precision_passes("int8_sq", SMOLLM2, 512) == 1.0
    assert costs.precision_passes("int4_awq", SMOLLM2, 512) == pytest.approx(1 + 1 + 11 * share)
    assert costs.precision_passes("mixed", SMOLLM2, 512) is None


def test_the_plan_predicts_awq_from_fp8_through_the_cost_model_not_as_fp8():
    fp8 = {"machine": "m", "stage": "quantize", "device": "cpu:x86_64", "variant": "fp8/kv=none", "params": 100,
           "size": 8192, "wall_time_s": 60.0}
    awq_passes = costs.precision_passes("int4_awq", SMOLLM2, 512)
    want = costs.work("cpu:x86_64", "int4_awq/kv=none", 100, 16384, passes=awq_passes)
    for record in (fp8, {**fp8, "passes": 1.0}):  # a record from before passes were recorded, and one after
        est = costs.estimate([record], "quantize", want, machine="m")
        assert est.rough and est.seconds == pytest.approx(60.0 * 2 * awq_passes, rel=1e-3)
    own = {**fp8, "variant": "int4_awq/kv=none", "passes": awq_passes, "wall_time_s": 700.0}
    est = costs.estimate([fp8, own], "quantize", want, machine="m")  # a build of its own wins
    assert not est.rough and est.seconds == pytest.approx(1400.0, rel=1e-3)


# ---------------------------------------------------------------------------------------- latency, fake clock
class _Clock(types.SimpleNamespace):
    """time as seen by quantlab.search.latency: every timed forward pass takes exactly `step` seconds."""

    def __init__(self, step: float):
        import time

        super().__init__(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_") and k != "perf_counter"})
        self.t, self.step, self.calls = 0.0, step, 0

    def perf_counter(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:
            self.t += self.step
        return self.t


def test_latency_search_decision_on_a_deterministic_clock(tiny_llama, tmp_path, monkeypatch):
    """search.cost=latency where no format is faster than the unquantized model (every pass takes 10 ms on this
    clock): the search says so (exit 1) with the measurements and evaluates nothing. The same logic timed for real
    lives in bench/latency_search.py: timing belongs to a benchmark, not to the unit tier."""
    from quantlab import api
    from quantlab.search import latency

    clock = _Clock(0.010)
    monkeypatch.setattr(latency, "time", clock)
    result = api.run(["+search=cheapest", *FAST, f"model.path={tiny_llama}", f"cache_dir={tmp_path / 'cache'}",
                      "search.cost=latency", "search.min_speedup=0.5", "search.latency_repeats=3",
                      "search.latency_tokens=32"], tmp_path / "run")
    assert result.exit_code == 1
    lat = result.doc["latency"]
    formats = {n: m for n, m in lat["measured"].items() if n != "none"}
    assert all(m["ms"] == pytest.approx(10.0) for m in lat["measured"].values()), lat
    # paired rounds in looks of 3: the median ratio's 1.25% one-sided bound needs 9 rounds (P(Bin(9, 1/2) = 0) =
    # 1/512), where ratio 1.0 is decidedly not 2x faster
    assert all(m["repeats"] == 9 and m["decision"] == "not faster" and m["ratio"] == pytest.approx(1.0)
               for m in formats.values()), formats
    assert lat["measured"]["none"]["repeats"] == 9 * len(formats)
    assert sorted(lat["not_faster"]) == sorted(n for n in lat["measured"] if n != "none")
    assert result.doc["evaluations"] == [] and result.doc["winner"] is None
    assert "No allowed format is faster" in (tmp_path / "run" / "report.md").read_text()
