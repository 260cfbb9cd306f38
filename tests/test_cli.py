"""The real CLI in a subprocess: runs, reuse, multirun and its exit 2 on bad input; bad input that needs files or a
model, in-process through the same checks (each refused with its message, before compute)."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import FAST, read_json, run_cli


def _bad_dirs(tmp_path, tiny_llama):
    """Broken inputs built from a good tiny checkpoint."""
    out = {}
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    out["bert"] = bert
    trunc = tmp_path / "truncated"
    shutil.copytree(tiny_llama, trunc)
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    out["truncated"] = trunc
    notok = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_llama, notok)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (notok / name).unlink(missing_ok=True)
    out["no_tokenizer"] = notok
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy2(tiny_llama / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    out["pickled"] = pickled
    files = tmp_path / "files"
    files.mkdir()
    (files / "empty.txt").write_text("")
    (files / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    (files / "binary.txt").write_bytes(b"\x00\x01\x02\x03" * 100)
    (files / "short.txt").write_text("a few words only")
    (files / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    out["files"] = files
    return out


# Bad input that needs files or a model: refused by the run itself before any compute. Run in-process through the
# CLI's own sequence (check_argv, then api.run: compose, preflight, prepare, data); config-only bad input is checked
# in tests/test_configs.py, and two cases go through the real CLI below (exit 2, one short paragraph, no traceback).
ERRORS = [
    (["+precision=fp8", "model.path=/nonexistent/model"], "does not exist"),
    (["+precision=fp8", "model.path={bert}"], "not a causal LM"),
    (["+precision=fp8", "model.path={truncated}"], "truncated or corrupt"),
    (["+precision=fp8", "model.path={no_tokenizer}"], "has no tokenizer"),
    (["+precision=fp8", "model.path={pickled}"], "pickle files are never loaded"),
    (["+precision=int4_awq", "model.path={qwen2}", "precision.block_size=128"], "use precision.block_size=64"),
    (["+precision=fp8", "model.path={llama}", "calib.path={files}/empty.txt"], "is empty"),
    (["+precision=fp8", "model.path={llama}", "calib.path={files}/latin1.txt"], "is not UTF-8"),
    (["+precision=fp8", "model.path={llama}", "calib.path={files}/binary.txt"], "looks binary"),
    (["+precision=fp8", "model.path={llama}", "calib.path={files}/short.txt"], "calib.num_samples x calib.seq_len"),
    (["+precision=fp8", "model.path={llama}", "eval.path={files}/short.txt"], "shorter than one window"),
    (["+precision=fp8", "model.path={llama}", "calib.path={files}/bad.jsonl"], "line 2 is not JSON"),
    (["+precision=fp8", "model.path={llama}", "eval.seq_len=1024"], "over the model's max positions (512)"),
    (["+precision=fp8", "model.path={llama}", "engine.max_seq_len=128", "eval.seq_len=256"], "max_input_len=128"),
    (["+precision=fp8", "model.path={llama}", "calib.dataset=cnn_dailymail"], "not available here"),
    (["+precision=fp8", "model.path={llama}", "gate.baseline={files}/short.txt"], "is not JSON"),
]
CLI_ERRORS = [  # one refused before Hydra composes (argv checks), one refused inside the run (a damaged model)
    (["+precision=fp9"], "unknown precision 'fp9'; did you mean 'fp8'"),
    (["+precision=fp8", "model.path={truncated}"], "truncated or corrupt"),
]


def _argv(args, tmp_path, tiny_llama, tiny_qwen2):
    """The case's arguments with its directories filled in, then FAST's settings it does not set itself."""
    dirs = _bad_dirs(tmp_path, tiny_llama)
    fill = {**{k: str(v) for k, v in dirs.items()}, "llama": str(tiny_llama), "qwen2": str(tiny_qwen2)}
    argv = [a.format(**fill) for a in args]
    return argv + [a for a in FAST if not any(a.split("=")[0] == b.split("=")[0] for b in argv)]


@pytest.mark.parametrize("args,message", ERRORS, ids=[m[:40] for _, m in ERRORS])
def test_bad_input_is_refused_before_compute(args, message, tmp_path, tiny_llama, tiny_qwen2, shared_cache,
                                             monkeypatch):
    from quantlab import api
    from quantlab.cli import check_argv
    from quantlab.errors import EXIT_BAD_INPUT, QuantlabError

    monkeypatch.setenv("QUANTLAB_CACHE", str(shared_cache))
    argv = check_argv(_argv(args, tmp_path, tiny_llama, tiny_qwen2))
    with pytest.raises(QuantlabError) as err:
        api.run(argv, tmp_path / "run")
    text = f"quantlab: error: {err.value}"  # what the CLI prints for it
    assert err.value.exit_code == EXIT_BAD_INPUT
    assert message in text, text
    assert "Traceback" not in text
    assert len(text.splitlines()) <= 6, text
    assert not (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.parametrize("args,message", CLI_ERRORS, ids=[m[:40] for _, m in CLI_ERRORS])
def test_bad_input_exits_2(args, message, tmp_path, tiny_llama, tiny_qwen2, shared_cache):
    res = run_cli(_argv(args, tmp_path, tiny_llama, tiny_qwen2), cwd=tmp_path, cache=shared_cache)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    assert message in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 12, res.stderr


def test_run_then_rerun_reuses_everything(tmp_path, tiny_llama):
    """The rerun from a cold interpreter, the way a user starts it (most CLI tests fork warm: tests/_warm.py; the
    SIGKILL and Ctrl-C tests start cold processes that calibrate)."""
    cache = tmp_path / "cache"
    args = ["+precision=fp8", f"model.path={tiny_llama}", *FAST]
    first = run_cli(args, cwd=tmp_path, cache=cache)
    assert first.returncode in (0, 1), first.stderr[-3000:]
    assert "calibration batch" in first.stderr + first.stdout
    runs = sorted((tmp_path / "outputs").iterdir())
    assert len(runs) == 1 and (runs[0] / "metrics.json").is_file() and (runs[0] / "junit.xml").is_file()
    assert first.stdout.strip().splitlines()[-1].endswith(str(runs[0]))

    second = run_cli(args, cwd=tmp_path, cache=cache, cold=True)
    assert second.returncode == first.returncode
    assert "calibration batch" not in second.stderr + second.stdout
    runs = sorted((tmp_path / "outputs").iterdir())
    record = read_json(runs[-1] / "run.json")
    built = [e for e in record["events"] if e["action"] == "built"]
    assert built == [], built
    assert {e["stage"] for e in record["events"]} >= {"data", "export", "evaluate"}
    m1, m2 = (read_json(r / "metrics.json")["metrics"] for r in runs)
    assert m1 == m2


def test_multirun_three_precisions_and_precision_without_plus(tmp_path, tiny_llama, shared_cache):
    res = run_cli(["-m", "precision=fp8,int8_sq,int4_awq", f"model.path={tiny_llama}", "stop_after=export", *FAST],
                  cwd=tmp_path, cache=shared_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    sweeps = list((tmp_path / "outputs").glob("sweep_*"))
    assert len(sweeps) == 1
    runs = sorted(p for p in sweeps[0].iterdir() if (p / "run.json").is_file())
    algos = sorted(read_json(r / "run.json")["artifacts"]["export"]["quant_algo"] for r in runs)
    assert algos == ["FP8", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL"]


@pytest.mark.slow
def test_default_model_end_to_end(tmp_path):
    """README quick start: the embedded SmolLM2 with its default settings."""
    res = run_cli(["+precision=fp8"], cwd=tmp_path, cache=tmp_path / "cache", timeout=1800)
    assert res.returncode in (0, 1), res.stderr[-3000:]
    run = next((tmp_path / "outputs").iterdir())
    doc = read_json(run / "metrics.json")
    assert doc["run"]["model"] == "smollm2-135m-instruct"
    assert 0.5 < doc["metrics"]["top1_agreement"]["value"] <= 1.0
    assert doc["gate"]["passed"] == (res.returncode == 0)


def test_rerun_reads_the_stored_evaluation(tmp_path, tiny_llama):
    """The candidate evaluation is an artifact too: a rerun reports the same metrics with no forward pass."""
    cache = tmp_path / "cache"
    args = ["+precision=int8_sq", f"model.path={tiny_llama}", *FAST]
    first, second = (run_cli(args, cwd=tmp_path, cache=cache) for _ in range(2))
    assert first.returncode == second.returncode
    runs = sorted((tmp_path / "outputs").iterdir())
    a, b = (read_json(r / "metrics.json") for r in runs)
    assert a["metrics"] == b["metrics"] and a["windows"] == b["windows"]
    assert a["run"]["candidate_forward_batches"] > 0 and b["run"]["candidate_forward_batches"] == 0
    assert (runs[1] / "report.html").is_file()
