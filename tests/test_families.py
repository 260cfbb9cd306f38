"""The architecture matrix: a tiny model of every family in the README's support table, saved by transformers itself,
through real calibration and export, and the torch engine (reading only the export) against ModelOpt's fake-quant
model after export's own transformations (eval.attribution), within the measured noise floor.

The default run covers the attention layouts that broke before (sliding windows with FP8 KV, soft-capping, fused
qkv, dual RoPE, MoE); `-m slow` runs every verified precision of every family with and without FP8 KV
(bench/family_matrix.py runs the same matrix outside pytest, on the H200 too)."""
from __future__ import annotations

import pytest
from conftest import FAST, read_json, run_api

from quantlab.families import FAMILIES

# the default tier: one run per attention / layout variant that broke before (sliding window with FP8 KV, fused
# qkv, NeoX's fused query_key_value, soft-capping, MoE experts); every other combination (Gemma 3's dual RoPE
# included) is in -m slow
DEFAULT = [("mistral", "fp8", "fp8"), ("phi3", "fp8", "fp8"), ("gpt_neox", "int8_sq", "fp8"),
           ("gemma2", "fp8", "fp8"), ("mixtral", "int4_awq", "fp8")]
CPU_FAKEQUANT = ("fp8", "fp8_pc_pt", "int8_sq", "int4_awq", "w4a8_awq")  # nvfp4's fake-quant needs CUDA
FULL = [(f.name, p, kv) for f in FAMILIES.values() for p in f.precisions if p in CPU_FAKEQUANT
        for kv in ("none", "fp8") if (f.name, p, kv) not in DEFAULT]


def _check(family, precision, kv, family_model, tmp_path, cache):
    model = family_model(family)
    code = run_api([f"+precision={precision}", f"kv_cache={kv}", f"model.path={model}", f"cache_dir={cache}",
                    "eval.attribution=true", *FAST], tmp_path)
    doc = read_json(tmp_path / "metrics.json")
    att = doc["attribution"]
    floor = att["exported_jitter_floor_top1"]
    assert att["engine_vs_exported_top1"] >= min(0.99, floor), att
    fq, en = att["metrics"]["kl_mean"]["fakequant_exported"], att["metrics"]["kl_mean"]["torch"]
    assert abs(en - fq) <= 0.1 * fq + 1e-4, att
    assert code in (0, 1) and doc["run"]["model"] == model.name
    return doc


@pytest.mark.parametrize("family,precision,kv", DEFAULT)
def test_family_engine_matches_fakequant(family, precision, kv, family_model, tmp_path, shared_cache):
    doc = _check(family, precision, kv, family_model, tmp_path, shared_cache)
    if FAMILIES[family].moe:
        assert "router_topk_agreement" in doc["metrics"]


@pytest.mark.slow
@pytest.mark.parametrize("family,precision,kv", FULL)
def test_family_matrix(family, precision, kv, family_model, tmp_path, shared_cache):
    _check(family, precision, kv, family_model, tmp_path, shared_cache)


def test_saved_checkpoints_are_accepted_with_their_disk_names(family_model):
    """Checkpoints transformers itself saved (NeoX's embed_out, MoE per-expert tensors) pass the model check."""
    from conftest import compose

    from quantlab.artifacts import ArtifactStore
    from quantlab.stages import prepare

    for family in ("gpt_neox", "mixtral", "qwen3_moe", "gemma3_text"):
        cfg, _ = compose(["+precision=fp8", f"model.path={family_model(family)}"])
        ref = prepare.run(cfg.model, ArtifactStore(family_model(family).parent / "cache"))
        assert ref.name == family_model(family).name


def test_unverified_family_is_refused_before_calibration(tok_dir, tmp_path):
    import shutil

    import torch
    from conftest import _train, run_cli
    from transformers import CohereConfig, CohereForCausalLM

    out = tmp_path / "cohere_tiny"
    torch.manual_seed(0)
    model = CohereForCausalLM(CohereConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    _train(model, tok_dir, steps=1)
    model.save_pretrained(out, safe_serialization=True)
    for f in tok_dir.iterdir():
        shutil.copy2(f, out / f.name)
    res = run_cli(["+precision=fp8", f"model.path={out}", *FAST], cwd=tmp_path, cache=tmp_path / "c")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "model family 'cohere' is not one quantlab has verified" in res.stderr and "Traceback" not in res.stderr
    assert "calibration batch" not in res.stdout + res.stderr


def test_nvfp4_fakequant_needs_cuda(family_model, tmp_path):
    from conftest import run_cli

    res = run_cli(["+precision=nvfp4", "engine=fakequant", f"model.path={family_model('llama')}", *FAST], cwd=tmp_path,
                  cache=tmp_path / "c")
    assert res.returncode == 2 and "NVFP4 fake-quant model runs only on CUDA" in res.stderr, res.stderr[-2000:]


def test_moe_smoothquant_is_refused_with_the_reason(family_model, tmp_path):
    """ModelOpt does not SmoothQuant fused experts (measured: the export ships no expert pre_quant_scale): exit 2
    before calibration, naming why and what runs instead."""
    from conftest import run_cli

    cache = tmp_path / "c"
    res = run_cli(["+precision=int8_sq", f"model.path={family_model('mixtral')}", f"cache_dir={cache}", *FAST],
                  cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "does not SmoothQuant fused MoE experts" in res.stderr and "int4_awq" in res.stderr
    assert not (cache / "quantize").exists()
