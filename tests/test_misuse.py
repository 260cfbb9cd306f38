"""A gate that cannot be fooled: each class of misuse (README "Faults and bad inputs") refused with exit 2 and the
fix, never silently accepted, never a traceback; reports that always match the run that wrote them; no data loss.

Config-only classes are checked in-process (the same QuantlabError the CLI turns into exit 2); what needs files,
processes or the CLI runs the real CLI in a subprocess."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import FAST, compose, read_json, run_api, run_cli
from safetensors.torch import load_file, save_file

from quantlab.artifacts import ArtifactStore
from quantlab.errors import QuantlabError
from quantlab.preflight import check_config
from quantlab.stages import data


def _exit2(res, message):
    assert res.returncode == 2, res.stdout[-1500:] + res.stderr[-2500:]
    assert message in res.stderr, res.stderr[-2500:]
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 12, res.stderr


# ------------------------------------------------------------------------------- silent acceptance
@pytest.mark.parametrize("overrides,message", [
    (["model.path="], "model.path is empty"),
    (["gate.baseline="], "gate.baseline is empty"),
    (["calib.path="], "calib.path is empty"),
    (["cache_dir="], "cache_dir is empty"),
])
def test_empty_value_is_never_the_default(overrides, message):
    cfg, _ = compose(["+precision=fp8", *overrides])
    with pytest.raises(QuantlabError, match=message):
        check_config(cfg)


def test_empty_model_path_on_the_cli(tmp_path):
    _exit2(run_cli(["+precision=fp8", "model.path=", *FAST], cwd=tmp_path, cache=tmp_path / "c"), "model.path is empty")


def test_an_unknown_kernel_name_is_refused_before_compute(tmp_path, monkeypatch):
    from quantlab.compose import compose
    from quantlab.engines.kernels.names import ENV_DISABLED, KERNELS
    from quantlab.engines.registry import KernelsConfig

    with pytest.raises(QuantlabError, match="'int4_mmma' is not one of quantlab's kernels; did you mean 'int4_mma'"):
        compose(["+precision=int4_awq", "engine.kernels.disabled=[int4_mmma]"])
    cfg, snapshot = compose(["+precision=int4_awq", "engine.kernels.disabled=[int4_mma,fp8_gemv]",
                             "engine.kernels.pdl=false"])
    assert cfg.engine.kernels.resolved() == {"disabled": ["fp8_gemv", "int4_mma"], "pdl": False, "compile_edges": True,
                                             "combo_kernels": True}
    assert snapshot["engine"]["kernels"]["disabled"] == ["int4_mma", "fp8_gemv"]  # what run.json's config holds
    assert set(KernelsConfig(disabled=["all", *KERNELS]).disabled) >= set(KERNELS)
    monkeypatch.setenv(ENV_DISABLED, "decode_attention, int4_k8")  # benches: added to the config's list
    assert KernelsConfig(disabled=["all"]).resolved()["disabled"] == ["all", "decode_attention", "int4_k8"]
    monkeypatch.setenv(ENV_DISABLED, "attention")
    with pytest.raises(QuantlabError, match=f"\\${ENV_DISABLED}: 'attention' is not one"):
        KernelsConfig().resolved()
    res = run_cli(["+precision=fp8", "engine.kernels.disabled=[fp8_gmev]", *FAST], cwd=tmp_path, cache=tmp_path / "c")
    _exit2(res, "did you mean 'fp8_gemv'")
    assert not list((tmp_path / "c").glob("*/*/manifest.json")), "something was computed"
    monkeypatch.delenv(ENV_DISABLED)
    monkeypatch.setenv("QUANTLAB_PDL", "0")  # an earlier version's switch: refused, never silently ignored
    with pytest.raises(QuantlabError, match="QUANTLAB_PDL is no longer read") as err:
        KernelsConfig().resolved()
    assert "engine.kernels.pdl=false" in err.value.fix


@pytest.mark.parametrize("overrides,message", [
    (["gate.thresholds.ppl_ratio.max=0"], "always > 0"),
    (["gate.thresholds.top1_agreement.min=0.9", "gate.thresholds.top1_agreement.max=0.8"], "so no value can pass"),
    (["gate.thresholds.kl_mean.max=nan"], "not a finite number"),
    (["gate.statistical.alpha=1.2"], "strictly between 0 and 1"),
    (["gate.statistical.beta=0"], "strictly between 0 and 1"),
])
def test_gate_parameters_are_validated_before_compute(overrides, message):
    cfg, _ = compose(["+precision=fp8", *overrides])
    with pytest.raises(QuantlabError, match=message):
        check_config(cfg)


@pytest.mark.parametrize("overrides,message", [
    (["engine=fakequant", "eval.attribution=true"], "eval.attribution=true splits the loss of an engine"),
    (["engine=reference", "kv_cache=fp8"], "has no effect on engine=reference"),
    (["engine.checkpoint=/x", "stop_after=quantize"], "nothing to calibrate"),
])
def test_options_the_engine_would_ignore_are_refused(overrides, message):
    cfg, _ = compose(["+precision=fp8", *overrides])
    with pytest.raises(QuantlabError, match=message):
        check_config(cfg)


def test_identity_keys_are_not_settable(tmp_path):
    res = run_cli(["+precision=fp8", "precision.name=int4_awq", *FAST], cwd=tmp_path, cache=tmp_path / "c")
    _exit2(res, "has no 'name'")
    res = run_cli(["+precision=fp8", "engine=fakequant", "engine.checkpoint=/somewhere", *FAST], cwd=tmp_path)
    _exit2(res, "only torch, trtllm have 'checkpoint'")


# --------------------------------------------------------------------------------------- pairings
def _export(model_dir, tmp_path, cache, name="export_run"):
    run_api(["+precision=fp8", f"model.path={model_dir}", f"cache_dir={cache}", "stop_after=export", *FAST],
            tmp_path / name)
    dst = tmp_path / f"{name}_ckpt"
    shutil.copytree((tmp_path / name / "checkpoint").resolve(), dst)
    return dst


def test_checkpoint_of_another_model_is_refused(tiny_llama, tiny_qwen2, tmp_path, shared_cache):
    other = _export(tiny_qwen2, tmp_path, shared_cache)
    _exit2(run_cli(["+precision=fp8", f"model.path={tiny_llama}", f"engine.checkpoint={other}", *FAST], cwd=tmp_path,
                   cache=shared_cache), "was exported from another model")
    # same shapes, other weights: the tiny Llama with its embedding moved (what retraining it with its builder's
    # fixed seed and shifting the embedding gave, without the training)
    twin = tmp_path / "twin"
    shutil.copytree(tiny_llama, twin)
    with torch.no_grad():
        tensors = load_file(str(twin / "model.safetensors"))
        tensors["model.embed_tokens.weight"] += 0.01
        save_file(tensors, str(twin / "model.safetensors"))
    ckpt = _export(tiny_llama, tmp_path, shared_cache, "llama_export")
    _exit2(run_cli(["+precision=fp8", f"model.path={twin}", f"engine.checkpoint={ckpt}", *FAST], cwd=tmp_path,
                   cache=shared_cache), "model.embed_tokens.weight differs")


def test_quantized_checkpoint_is_not_a_reference(tiny_llama, tmp_path, shared_cache):
    ckpt = _export(tiny_llama, tmp_path, shared_cache)
    _exit2(run_cli(["+precision=fp8", f"model.path={ckpt}", *FAST], cwd=tmp_path, cache=shared_cache),
           "already a quantized checkpoint")
    (ckpt / "hf_quant_config.json").unlink()  # the tensors still say so
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("quantization_config", None)
    (ckpt / "config.json").write_text(json.dumps(config))
    _exit2(run_cli(["+precision=fp8", f"model.path={ckpt}", *FAST], cwd=tmp_path, cache=shared_cache),
           "holds quantized tensors")


def test_pickle_beside_safetensors_is_never_loaded(tiny_llama, tmp_path):
    from quantlab.env import resolve_device
    from quantlab.models import load_model
    from quantlab.stages import prepare

    model_dir = tmp_path / "with_pickle"
    shutil.copytree(tiny_llama, model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"not a pickle at all")  # loading it would fail
    cfg, _ = compose(["+precision=fp8", f"model.path={model_dir}"])
    store = ArtifactStore(tmp_path / "c")
    ref = prepare.run(cfg.model, store)
    model = load_model(ref, resolve_device("cpu"), torch.float32)  # reads the safetensors, not the .bin
    assert model is not None
    (model_dir / "pytorch_model.bin").write_bytes(b"changed")  # what is never read never changes the identity
    assert prepare.run(cfg.model, store).fingerprint == ref.fingerprint


# ------------------------------------------------------------------------------------- file types
def _data_cfg(path, **kw):
    cfg, _ = compose(["+precision=fp8", f"eval.path={path}", *[f"eval.{k}={v}" for k, v in kw.items()]])
    return cfg.eval


@pytest.mark.parametrize("name,content,kw", [
    ("records.json", '{"text": "alpha beta"}\n{"text": "gamma"}\n', {}),  # what datasets' to_json writes
    ("records.JSONL", '{"text": "alpha beta"}\n{"text": "gamma"}\n', {}),
    ("array.json", '[{"text": "alpha beta"}, {"text": "gamma"}]', {}),
    ("table.csv", 'id,text\n1,"alpha beta"\n2,gamma\n', {}),
    ("table.TSV", 'id\ttext\n1\talpha beta\n2\tgamma\n', {}),
    ("other.csv", 'id,body\n1,"alpha beta"\n2,gamma\n', {"text_field": "body"}),
])
def test_common_formats_are_read_as_records(name, content, kw, tmp_path):
    path = tmp_path / name
    path.write_text(content)
    text, desc = data.read_text(_data_cfg(path, **kw), data.EVAL)
    assert text == "alpha beta\n\ngamma", (name, text)


def test_parquet_is_read_as_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["alpha beta", "gamma"], "n": [1, 2]}), tmp_path / "t.parquet")
    assert data.read_text(_data_cfg(tmp_path / "t.parquet"), data.EVAL)[0] == "alpha beta\n\ngamma"


def test_unknown_file_type_is_refused_and_format_overrides(tmp_path):
    path = tmp_path / "notes.xyz"
    path.write_text("plain words here")
    with pytest.raises(QuantlabError, match="does not know the file type '.xyz'"):
        data.read_text(_data_cfg(path), data.EVAL)
    assert data.read_text(_data_cfg(path, format="text"), data.EVAL)[0] == "plain words here"
    (tmp_path / "wiki.test.raw").write_text(" = Title = \n text")
    assert data.read_text(_data_cfg(tmp_path / "wiki.test.raw"), data.EVAL)[0] == " = Title = \n text"
    bad = tmp_path / "rows.csv"
    bad.write_text("id,body\n1,x\n")
    with pytest.raises(QuantlabError, match="has no column 'text'"):
        data.read_text(_data_cfg(bad), data.EVAL)


# ----------------------------------------------------------------------------------- stale verdicts
def test_reports_always_match_the_run_that_wrote_them(tiny_llama, tmp_path, shared_cache):
    run_dir = tmp_path / "ci_run"
    args = ["+precision=fp8", f"model.path={tiny_llama}", *FAST, f"hydra.run.dir={run_dir}"]
    assert run_cli(args, cwd=tmp_path, cache=shared_cache).returncode == 0
    assert "PASS" in (run_dir / "report.md").read_text().splitlines()[0]
    failing = run_cli([*args, "gate.thresholds.top1_agreement.min=0.9999"], cwd=tmp_path, cache=shared_cache)
    assert failing.returncode == 1
    assert "FAIL" in (run_dir / "report.md").read_text().splitlines()[0]
    assert 'failures="0"' not in (run_dir / "junit.xml").read_text()
    assert read_json(run_dir / "run.json")["exit_code"] == 1
    bad = run_cli([*args, "eval.seq_len=100000"], cwd=tmp_path, cache=shared_cache)
    assert bad.returncode == 2
    assert not (run_dir / "report.md").exists() and not (run_dir / "junit.xml").exists()
    assert read_json(run_dir / "status.json")["exit_code"] == 2
    kept = sorted((run_dir / "previous").iterdir())
    assert len(kept) == 2 and all((k / "report.md").is_file() for k in kept)  # nothing already written is lost


def test_markdown_injection_through_the_model_name(tiny_llama, tmp_path, shared_cache):
    from quantlab import api

    evil = tmp_path / "m\n# Injected heading [link](http://evil.example) ![img](http://evil.example/x.png)"
    shutil.copytree(tiny_llama, evil)
    cfg, _ = compose(["+precision=fp8", f"model.path={tiny_llama}", f"cache_dir={shared_cache}", *FAST])
    cfg.model.path = str(evil)  # a directory name no shell quoting stops (the Python API takes it as is)
    assert api.run(cfg, tmp_path / "run").exit_code in (0, 1)
    md = (tmp_path / "run" / "report.md").read_text()
    headings = [line for line in md.splitlines() if line.startswith("#")]
    assert all(line.startswith(("## quantlab", "### ")) for line in headings), headings
    assert "](http" not in md and "![" not in md.replace("\\!\\[", "")


# --------------------------------------------------------------------------------------- data loss
def test_cache_prune_validates_and_never_touches_a_build_in_progress(tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    run_cli(["+precision=fp8", f"model.path={tiny_llama}", "stop_after=export", *FAST], cwd=tmp_path, cache=cache)

    def prune(*extra):
        return subprocess.run([sys.executable, "-m", "quantlab.cache", "prune", "--cache-dir", str(cache), *extra],
                              capture_output=True, text=True)

    for extra, message in ((["--older-than", "-1"], "is not a number of days >= 0"),
                           (["--older-than", "nan"], "is not a number of days >= 0"),
                           ([], "needs --older-than DAYS or --all")):
        res = prune(*extra)
        _exit2(res, message)
    store = ArtifactStore(cache)
    export = next(e for e in store.entries() if e.stage == "export")
    with store.lock("export", export.key):  # a process building (or rebuilding) this entry holds its lock
        res = prune("--all")
    assert res.returncode == 0 and "1 skipped" in res.stdout and (export.path / "manifest.json").is_file()
    assert prune("--all").returncode == 0 and not export.path.exists()
    res = subprocess.run([sys.executable, "-m", "quantlab.cache", "list", "--cache-dir", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    _exit2(res, "is not an existing cache directory")


def test_summary_cli_exit_codes(tmp_path):
    def summary(*args):
        return subprocess.run([sys.executable, "-m", "quantlab.summary", *args], capture_output=True, text=True)

    _exit2(summary(str(tmp_path)), "no run directories")
    _exit2(summary(str(tmp_path / "missing")), "not a directory")


# ------------------------------------------------------------------------- crashes on fixable input
def test_tokenizer_larger_than_the_embedding(tiny_llama, tmp_path):
    small = tmp_path / "small_vocab"
    shutil.copytree(tiny_llama, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 200  # the tokenizer has 512 tokens
    (small / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(small / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:200].contiguous()
    save_file(tensors, str(small / "model.safetensors"))
    _exit2(run_cli(["+precision=fp8", f"model.path={small}", *FAST], cwd=tmp_path, cache=tmp_path / "c"),
           "the tokenizer does not belong to this model")


def test_nan_weight_is_refused_by_name(tiny_llama, tmp_path):
    bad = tmp_path / "nan"
    shutil.copytree(tiny_llama, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(bad / "model.safetensors"))
    _exit2(run_cli(["+precision=fp8", f"model.path={bad}", *FAST], cwd=tmp_path, cache=tmp_path / "c"),
           "NaN/Inf value(s) in weight model.layers.1.mlp.up_proj.weight")


HOSTILE = [
    (b'{"w": {"dtype": "F32", "shape": [1000000000000, 1000000000000], "data_offsets": [0, 4]}}',
     "does not match its shape"),
    (b"[" * 100000, "header is not JSON"),
    (b'{"w": {"dtype": "XX", "shape": [1], "data_offsets": [0, 4]}}', "unknown dtype"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], '
     b'"data_offsets": [4, 12]}}', "overlap"),
    (b'{"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', "malformed shape"),
    (b'{"__metadata__": {"x": 1}}', "__metadata__ must map strings"),
]


@pytest.mark.parametrize("header,message", HOSTILE, ids=[m for _, m in HOSTILE])
def test_hostile_safetensors_header_is_refused_by_name(header, message, tmp_path):
    from quantlab.checkpoint import read_safetensors_header

    f = tmp_path / "model.safetensors"
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 12)
    with pytest.raises(QuantlabError, match=message):
        read_safetensors_header(f)


def test_hostile_safetensors_header_on_the_cli(tiny_llama, tmp_path):
    bad = tmp_path / "hostile"
    shutil.copytree(tiny_llama, bad)
    header = HOSTILE[0][0]
    (bad / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 12)
    _exit2(run_cli(["+precision=fp8", f"model.path={bad}", *FAST], cwd=tmp_path, cache=tmp_path / "c"),
           "model.safetensors is not a readable safetensors file")


def test_malformed_quant_config_in_an_external_checkpoint(tiny_llama, tmp_path, shared_cache):
    ckpt = _export(tiny_llama, tmp_path, shared_cache)
    (ckpt / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": 8}}')
    _exit2(run_cli(["+precision=fp8", f"model.path={tiny_llama}", f"engine.checkpoint={ckpt}", *FAST], cwd=tmp_path,
                   cache=shared_cache), "quant_algo=8, not a string")


def test_cache_dir_that_is_a_file_or_read_only_or_full(tiny_llama, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    _exit2(run_cli(["+precision=fp8", f"model.path={tiny_llama}", f"cache_dir={blocker}", *FAST], cwd=tmp_path),
           "is a file, not a directory")
    for i, (opts, message) in enumerate((("ro,size=1m", "not writable"), ("size=256k", "no space left"))):
        mount = tmp_path / f"mnt{i}"
        mount.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mount)], capture_output=True).returncode:
            pytest.skip("cannot mount a small tmpfs here (needs root): read-only / full cache not testable")
        try:
            res = run_cli(["+precision=fp8", f"model.path={tiny_llama}", f"cache_dir={mount}", *FAST], cwd=tmp_path)
            _exit2(res, message)
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True)


def test_ctrl_c_is_one_line_and_exit_130(tiny_llama, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "QUANTLAB_CACHE": str(tmp_path / "c"), "PYTHONUNBUFFERED": "1"}
    slow = ["calib.num_samples=24", "calib.seq_len=128", "calib.batch_size=1"]
    proc = subprocess.Popen([sys.executable, "-m", "quantlab", "+precision=int4_awq", f"model.path={tiny_llama}",
                             *[a for a in FAST if not a.startswith("calib.")], *slow], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            # a terminal's Ctrl-C: a test run started in the background (nohup, `&`) would
                            # otherwise pass on an ignored SIGINT, which Python then keeps ignoring
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline, lines = time.time() + 300, []
    for line in proc.stdout:
        lines.append(line)
        if "calibration batch" in line or time.time() > deadline:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, "".join(lines[-20:]) + rest
    assert "interrupted; finished artifacts are kept" in rest and "Traceback" not in rest


# ---------------------------------------------------------------------------------------- resources
def test_a_huge_single_line_costs_memory_for_the_windows_used_only(tiny_llama, tmp_path):
    """A 50 MB calibration file that is one line: reading stops once the windows exist (was 6.9 GiB)."""
    big = tmp_path / "one_line.txt"
    words = ("lorem ipsum dolor sit amet consectetur " * 1000).encode()
    with open(big, "wb") as f:
        while f.tell() < 50 << 20:
            f.write(words)
    code = ("import resource, sys; from quantlab.cli import main; rc = main(sys.argv[1:]); "
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "QUANTLAB_CACHE": str(tmp_path / "c")}
    res = subprocess.run([sys.executable, "-c", code, "+precision=fp8", f"model.path={tiny_llama}", f"calib.path={big}",
                          "stop_after=data", *FAST], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rss_mib = int(res.stdout.split("MAXRSS")[1].split()[0]) / 1024
    assert rss_mib < 1500, rss_mib  # the interpreter, torch and transformers alone take ~700 MiB
    record = read_json(next((tmp_path / "outputs").iterdir()) / "run.json")
    assert record["data"]["calib"]["chars_read"] < 8 << 20


# ---------------------------------------------------------------------------------------- look-alike inputs
def test_weights_a_loader_would_not_read_are_refused_by_name(tiny_llama, tmp_path):
    """A model directory whose safetensors file has a non-standard name next to a pickle of other weights (was
    exit 3: transformers looks for model.safetensors), and one with both model.safetensors and an index (two
    loaders, two models): exit 2 before anything loads, naming the files and the fix."""
    odd = tmp_path / "odd"
    shutil.copytree(tiny_llama, odd)
    os.replace(odd / "model.safetensors", odd / "weights.safetensors")
    torch.save({"lm_head.weight": torch.zeros(2, 2)}, odd / "pytorch_model.bin")
    _exit2(run_cli(["+precision=fp8", f"model.path={odd}", *FAST], cwd=tmp_path, cache=tmp_path / "c"),
           "weights.safetensors but no model.safetensors")
    both = tmp_path / "both"
    shutil.copytree(tiny_llama, both)
    names = list(load_file(str(both / "model.safetensors")))
    (both / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    with pytest.raises(QuantlabError, match="both model.safetensors and model.safetensors.index.json"):
        from quantlab.models import ModelRef

        ModelRef.from_path(both)
    stale = tmp_path / "stale"
    shutil.copytree(tiny_llama, stale)
    os.replace(stale / "model.safetensors", stale / "model-00001-of-00001.safetensors")
    (stale / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}))
    with pytest.raises(QuantlabError, match="model-00001-of-00002.safetensors, which is not in"):
        ModelRef.from_path(stale)


def test_baseline_may_be_a_run_directory(tmp_path):
    """gate.baseline pointing at a run directory (was "does not exist" for a directory that exists): its
    metrics.json is read; a directory without one is refused with the fix."""
    from quantlab.gate.checks import load_baseline

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(QuantlabError, match="a directory without a metrics.json"):
        load_baseline(str(run), {})
    (run / "metrics.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(QuantlabError, match="has schema 'other'"):  # read, then checked like a metrics.json
        load_baseline(str(run), {})


# ---------------------------------------------------------------------------------------- resources
def test_disk_full_while_writing_an_artifact_is_exit_2_and_a_rerun_with_room_works(tiny_llama, tmp_path):
    """The cache's disk fills while the export writes its safetensors (was exit 3, SafetensorError): exit 2 naming
    the cache and the space the build needed, no partial entry left, and the same command with room completes."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root): a full disk is not testable")
    try:
        args = ["+precision=fp8", f"model.path={tiny_llama}", f"cache_dir={mount}", *FAST]
        res = run_cli(args, cwd=tmp_path)
        _exit2(res, "no space left on the device of the cache")
        assert "needs more than" in res.stderr, res.stderr
        partial = [p for p in mount.rglob("*") if p.is_dir() and p.parent.name in ("export", "quantize", "data")
                   and not (p / "manifest.json").is_file()]
        assert not partial and not list((mount / ".tmp").glob("*")), partial
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True, capture_output=True)
        again = run_cli(args, cwd=tmp_path)
        assert again.returncode in (0, 1), again.stdout[-1500:] + again.stderr[-2500:]
        assert "reusing" in again.stderr or "reusing" in again.stdout  # what was finished before is kept
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_records_in_a_text_file_are_refused_and_a_bom_is_not_text(tmp_path):
    """JSON Lines saved under a text suffix would feed its JSON syntax to calibration: refused with the format to
    set; a UTF-8 byte-order mark in front of JSON Lines (some editors and exporters write one) is not a parse error."""
    from quantlab.config import CalibConfig

    rows = "".join(json.dumps({"text": f"record number {i} says hello"}) + "\n" for i in range(50))
    named_as_text = tmp_path / "records.txt"
    named_as_text.write_text(rows)
    with pytest.raises(QuantlabError, match="has a text suffix but holds JSON Lines") as err:
        data.source(CalibConfig(path=str(named_as_text)), data.CALIB)
    assert "calib.format=jsonl" in str(err.value)
    forced = data.read_text(CalibConfig(path=str(named_as_text), format="jsonl"), data.CALIB)[0]
    assert forced.startswith("record number 0 says hello") and "{" not in forced
    with_bom = tmp_path / "records.json"
    with_bom.write_bytes(b"\xef\xbb\xbf" + rows.encode())
    text = data.read_text(CalibConfig(path=str(with_bom)), data.CALIB)[0]
    assert text.startswith("record number 0 says hello") and "\ufeff" not in text


def test_evaluating_on_the_calibration_text_is_said_and_refused_under_strict(tiny_llama, tmp_path):
    """eval.path == calib.path (or text calibration saw) made an optimistic verdict without a word: the run warns
    in the console and the report, and gate=strict refuses it before any evaluation."""
    from quantlab.stages.data import pydoc_topics

    topics = pydoc_topics()
    text = tmp_path / "same.txt"
    text.write_text("\n\n".join(topics[k] for k in sorted(topics)[:40]))
    common = [f"model.path={tiny_llama}", f"calib.path={text}", f"eval.path={text}", *FAST]
    res = run_cli(["+precision=fp8", *common, "stop_after=data"], cwd=tmp_path, cache=tmp_path / "c")
    assert res.returncode == 0, res.stdout[-1500:] + res.stderr[-2500:]
    assert "the evaluation text is the calibration text" in res.stderr + res.stdout
    # gate=strict has no per-precision thresholds for FAST to drop
    strict = run_cli(["+precision=fp8", *(a for a in common if not a.startswith("~gate.per_precision")),
                      "gate=strict"], cwd=tmp_path, cache=tmp_path / "c")
    _exit2(strict, "the evaluation text is the calibration text")
    assert "refuse_calibration_overlap=false" in strict.stderr


def test_calibration_overlap_names_copied_documents_and_passes_over_shared_boilerplate():
    """data.overlap on token windows: a document calibration also read (all its tokens in shared runs of 32) is
    named; another that shares one 40-token run (boilerplate two documents of one kind hold) is not; the overall
    share counts both."""
    import numpy as np
    import torch

    from quantlab.stages.data import TokenSet, overlap

    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 50_000, (4, 128), generator=g)
    copied = calib[1].clone()  # document 0: calibration's second window verbatim
    other = torch.randint(0, 50_000, (3, 128), generator=g)  # document 1: new text ...
    other[1, 50:90] = calib[3, 10:50]  # ... but one 40-token run of boilerplate
    evalset = TokenSet("eval", "e", torch.stack([copied, *other]), {"identity": "e", "documents": {
        "labels": {"0": "the copied topic", "1": "a new topic"}}}, docs=np.array([0, 1, 1, 1]),
        positions=np.arange(4))
    found = overlap(TokenSet("calib", "c", calib, {"identity": "c"}), evalset)
    assert [d["document"] for d in found["copied_documents"]] == ["the copied topic"]
    assert found["copied_documents"][0]["share"] == 1.0
    assert found["share"] == pytest.approx((128 + 40) / (4 * 128))
    assert found["windows"] == [0, 2] and not found["same_source"]
