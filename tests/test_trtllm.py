"""engine=trtllm: the config -> LLM API mapping everywhere; a real run only where tensorrt_llm imports."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import FAST, compose, run_cli

from quantlab.engines.base import Limits
from quantlab.engines.trtllm import llm_kwargs
from quantlab.errors import QuantlabError

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def test_llm_api_arguments_from_config():
    cfg, _ = compose(["+precision=fp8", "kv_cache=fp8", "engine=trtllm", "engine.tensor_parallel_size=2",
                      "engine.max_batch_size=8", "engine.max_seq_len=4096", "engine.max_input_len=2048"])
    limits = Limits(max_input_len=2048, max_seq_len=4096, max_batch_size=8)
    kw = llm_kwargs(cfg.engine, Path("/ckpt"), limits, "FP8")
    assert kw["model"] == kw["tokenizer"] == "/ckpt"
    assert kw["backend"] == "pytorch" and kw["tensor_parallel_size"] == 2
    assert (kw["max_batch_size"], kw["max_seq_len"], kw["max_num_tokens"]) == (8, 4096, 8 * 2048)
    assert kw["kv_cache_config"] == {"dtype": "fp8", "enable_block_reuse": False}
    assert "max_input_len" not in kw
    cfg.engine.trtllm_backend = "tensorrt"
    kw = llm_kwargs(cfg.engine, Path("/ckpt"), limits, None)
    assert kw["kv_cache_config"]["dtype"] == "auto" and kw["max_input_len"] == 2048
    cfg.engine.trtllm_backend = "onnx"
    with pytest.raises(QuantlabError, match="trtllm_backend"):
        llm_kwargs(cfg.engine, Path("/ckpt"), limits, None)


@pytest.mark.skipif(HAVE_TRTLLM, reason="tensorrt_llm is installed here")
def test_missing_trtllm_is_a_clear_exit_2(tmp_path, tiny_llama, shared_cache):
    res = run_cli(["+precision=fp8", "engine=trtllm", f"model.path={tiny_llama}", *FAST], cwd=tmp_path,
                  cache=shared_cache)
    assert res.returncode == 2
    assert "needs TensorRT-LLM" in res.stderr and "pip install tensorrt_llm" in res.stderr


@pytest.mark.trtllm
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TRTLLM, reason="tensorrt_llm is not importable here (it needs Linux + an NVIDIA GPU)")
def test_trtllm_engine_agrees_with_torch_engine(tmp_path, tiny_llama, shared_cache):
    from conftest import read_json, run_api

    for engine in ("torch", "trtllm"):
        run_api(["+precision=fp8", f"engine={engine}", f"model.path={tiny_llama}", f"cache_dir={shared_cache}", *FAST],
                tmp_path / engine)
    a, b = (read_json(tmp_path / e / "metrics.json")["metrics"] for e in ("torch", "trtllm"))
    assert abs(a["ppl_ratio"]["value"] - b["ppl_ratio"]["value"]) < 0.01
