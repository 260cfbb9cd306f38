"""Shared fixtures: tiny random Llama / Qwen2 checkpoints with a real (small) BPE tokenizer, built offline.

Tests never read ../shared and never touch the hub.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _builders import family_configs as _family_configs  # noqa: F401 - the tests' names for them
from _builders import pinned
from _builders import train as _train  # noqa: F401
from _warm import WarmStarter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n 2 (the default): one thread per worker and its subprocesses
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent
# Small eval / calibration settings: seconds per run on a 2-core CPU. The default gate's tail checks (kl_tail,
# ppl_tail, top1_tail <= 5%) need 59 windows to pass, which 8 cannot give (exit 2): FAST runs drop them;
# tests/test_realtext.py tests them.
NO_TAILS = [f"~gate.{where}.{tail}" for tail in ("kl_tail", "ppl_tail", "top1_tail")
            for where in ("thresholds", "per_precision.int4_awq", "per_precision.w4a8_awq")]
FAST = ["calib.num_samples=4", "calib.seq_len=64", "calib.batch_size=2", "eval.seq_len=64", "eval.max_windows=8",
        "eval.batch_size=4", "eval.gen_prompts=2", "eval.gen_prompt_len=8", "eval.gen_tokens=6",
        "gate.statistical.look_windows=4", *NO_TAILS]


# ------------------------------------------------------------------------------- built once per test run
def _shared_root(tmp_path_factory) -> Path:
    """A directory every xdist worker of this test run sees (the run's base temp directory; without xdist, this
    process's). The tiny models are built there once, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built_once"
    root.mkdir(exist_ok=True)
    return root


def built_once(tmp_path_factory, name: str, build, meanwhile: tuple = ()) -> Path:
    """root/name, made by build(out) in exactly one worker of the run: a file lock per name; a worker that finds
    it taken builds what it will need next (`meanwhile`: (name, build) pairs nobody is building) and then waits.
    The builders are seeded, so which worker builds a model does not change a byte of it."""
    from filelock import FileLock, Timeout

    root = _shared_root(tmp_path_factory)
    out = root / name
    lock = FileLock(str(root / f".{name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:  # another worker is building it
        for other, other_build in meanwhile:
            other_lock = FileLock(str(root / f".{other}.lock"))
            try:
                other_lock.acquire(timeout=0)
            except Timeout:
                continue
            try:
                _build_into(root / other, other_build)
            finally:
                other_lock.release()
        lock.acquire()
    try:
        _build_into(out, build)
    finally:
        lock.release()
    return out


def _build_into(out: Path, build) -> None:
    """build(out) unless a finished build is there (the marker is written last; a half-written one is redone)."""
    import shutil

    done = out.parent / f".{out.name}.done"
    if done.exists():
        return
    shutil.rmtree(out, ignore_errors=True)
    build(out)
    done.write_text("")


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "tokenizer", lambda out: pinned("tokenizer", out))


def _tiny_builders(tok: Path) -> dict:
    return {"tiny_llama": lambda out: pinned("model", out, "llama", tok),
            "tiny_qwen2": lambda out: pinned("model", out, "qwen2", tok)}


def _tiny(tmp_path_factory, tok: Path, name: str) -> Path:
    builders = _tiny_builders(tok)
    return built_once(tmp_path_factory, name, builders[name], [(n, b) for n, b in builders.items() if n != name])


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tok_dir) -> Path:
    return _tiny(tmp_path_factory, tok_dir, "tiny_llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, tok_dir) -> Path:
    return _tiny(tmp_path_factory, tok_dir, "tiny_qwen2")


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One artifact cache for the test run, shared by the xdist workers (the store builds each artifact once across
    processes: a calibration or reference evaluation one module made is reused by another). Tests that need a cold
    cache, or count what a run builds, make their own."""
    out = _shared_root(tmp_path_factory) / "cache"
    out.mkdir(exist_ok=True)
    return out


def compose(overrides: list[str]):
    """The typed Config exactly as the CLI would build it (Hydra compose API, in-process)."""
    from quantlab.compose import compose as quantlab_compose

    return quantlab_compose(overrides)


def run_api(overrides: list[str], run_dir: Path) -> int:
    """One run through the Python entry point; its exit code."""
    from quantlab import api

    return api.run(overrides, run_dir).exit_code


_WARM = WarmStarter()
_WARM_OUTPUT = Path(tempfile.gettempdir()) / "quantlab-warm-output"


def pytest_sessionfinish(session, exitstatus):
    _WARM.close()


# the modules that take longest on the 2-core CI machine, longest first: xdist hands modules (--dist loadscope) to
# the worker that frees up first, in collection order, so starting with the long ones leaves no long tail on one
# worker at the end (the order of tests inside a module is unchanged)
LONGEST_FIRST = ("test_scaleout", "test_misuse", "test_search", "test_decode", "test_audit", "test_reliability",
                 "test_torch_engine", "test_families", "test_cli", "test_report", "test_evaluate", "test_summary")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (rank.get(Path(str(it.fspath)).stem, len(rank)), position[id(it)]))


def cli_env(cache: Path | None = None, env_extra: dict | None = None) -> dict:
    """The environment of a quantlab command in the tests: this process's, offline, library warnings off."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    if cache is not None:
        env["QUANTLAB_CACHE"] = str(cache)
    env.update(env_extra or {})
    return env


def _cold(env: dict, cold: bool) -> bool:
    return cold or os.environ.get("QUANTLAB_TEST_COLD") == "1" or not _WARM.usable(env)


class Started:
    """A `python -m MODULE` started with start_module, running while the test goes on."""

    def __init__(self, warm=None, popen: subprocess.Popen | None = None):
        self.warm, self.popen = warm, popen

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess:
        """Its exit code and output; subprocess's TimeoutExpired (the process killed) after TIMEOUT seconds."""
        if self.popen is None:
            return _WARM.wait(self.warm, timeout)
        try:
            out, err = self.popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # as subprocess.run does
            self.popen.kill()
            self.popen.communicate()
            raise
        return subprocess.CompletedProcess(self.popen.args, self.popen.returncode, out, err)


def start_module(module: str, args: list[str], cwd: Path, env: dict, cold: bool = False) -> Started:
    """Start `python -m MODULE ARGS` in its own process (warm unless cold; see run_module) and return at once."""
    if _cold(env, cold):
        return Started(popen=subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return Started(warm=_WARM.spawn(module, [str(a) for a in args], Path(cwd), env, _WARM_OUTPUT))


def run_module(module: str, args: list, cwd: Path, env: dict, timeout: float = 600,
               cold: bool = False) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in its own process: forked from this worker's warm parent (tests/_warm.py: the heavy
    libraries imported once, quantlab imported fresh), or started cold with `cold=True`, with
    QUANTLAB_TEST_COLD=1, or when the environment differs from the warm parent's."""
    return start_module(module, args, cwd, env, cold).wait(timeout)


def run_cli(args: list[str], cwd: Path, cache: Path | None = None, timeout: int = 600, env_extra: dict | None = None,
            cold: bool = False):
    """`python -m quantlab ARGS` (see run_module)."""
    return run_module("quantlab", args, cwd, cli_env(cache, env_extra), timeout, cold)


def chromium():
    """Debian's chromium and playwright's sync API for browser tests, or the test skipped with the reason."""
    import shutil

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright (Python) is not installed")
    return exe, sync_playwright


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="session")
def family_model(tmp_path_factory, tok_dir):
    """family name -> a tiny trained checkpoint of it (built once per test run, on first use)."""

    def get(name: str) -> Path:
        return built_once(tmp_path_factory, f"family_{name}", lambda out: pinned("family", out, name, tok_dir))

    return get
