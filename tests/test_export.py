"""Real ModelOpt calibration + export on tiny Llama / Qwen2 checkpoints; the exported files read back."""
from __future__ import annotations

import json

import pytest
from conftest import FAST, read_json, run_api
from safetensors import safe_open

CASES = [
    ("llama", "fp8", "none", "FP8", None),
    ("llama", "fp8", "fp8", "FP8", "FP8"),
    ("llama", "int8_sq", "none", "W8A8_SQ_PER_CHANNEL", None),
    ("llama", "int8_sq", "fp8", "W8A8_SQ_PER_CHANNEL", "FP8"),
    ("llama", "int4_awq", "none", "W4A16_AWQ", None),
    ("qwen2", "fp8", "fp8", "FP8", "FP8"),
    ("qwen2", "int8_sq", "none", "W8A8_SQ_PER_CHANNEL", None),
    ("qwen2", "int4_awq", "fp8", "W4A16_AWQ", "FP8"),
]


def _tensors(ckpt):
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.parametrize("family,precision,kv,algo,kv_algo", CASES)
def test_quantize_export(family, precision, kv, algo, kv_algo, request, tmp_path, shared_cache):
    import torch

    model_dir = request.getfixturevalue(f"tiny_{family}")
    extra = ["precision.block_size=32"] if precision == "int4_awq" and family == "qwen2" else []
    code = run_api([f"+precision={precision}", f"kv_cache={kv}", f"model.path={model_dir}", f"cache_dir={shared_cache}",
                    "stop_after=export", *FAST, *extra], tmp_path)
    assert code == 0
    ckpt = (tmp_path / "checkpoint").resolve()
    quant = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == algo
    assert quant["kv_cache_quant_algo"] == kv_algo
    assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    t = _tensors(ckpt)
    layer = "model.layers.0"
    q = t[f"{layer}.self_attn.q_proj.weight"]
    if precision == "fp8":
        assert q.dtype == torch.float8_e4m3fn
        assert t[f"{layer}.self_attn.q_proj.weight_scale"].numel() == 1
        assert t[f"{layer}.mlp.down_proj.input_scale"].numel() == 1
        assert float(t[f"{layer}.mlp.down_proj.input_scale"]) > 0
    elif precision == "int8_sq":
        assert q.dtype == torch.int8
        assert t[f"{layer}.self_attn.q_proj.weight_scale"].shape == (q.shape[0],)  # per output channel
        assert f"{layer}.self_attn.q_proj.pre_quant_scale" in t
        assert t[f"{layer}.self_attn.q_proj.input_scale"].numel() == 1
    else:
        block = quant["group_size"]
        assert block == (32 if family == "qwen2" else 128)
        assert q.dtype == torch.uint8  # two int4 values per byte
        out_dim, groups = t[f"{layer}.self_attn.q_proj.weight_scale"].shape
        assert q.shape == (out_dim // 2, groups * block)  # [out/2, in], one scale per block of `block` inputs
    if kv_algo:
        k_scale = t[f"{layer}.self_attn.k_proj.k_scale"]
        v_scale = t[f"{layer}.self_attn.v_proj.v_scale"]
        assert float(k_scale) > 0 and float(v_scale) > 0
        assert not (float(k_scale) == 1.0 and float(v_scale) == 1.0), "KV scales left at 1.0"
    record = read_json(tmp_path / "run.json")
    assert record["artifacts"]["export"]["quant_algo"] == algo
    manifest = read_json(ckpt / "manifest.json")
    assert manifest["stage"] == "export" and manifest["versions"]["nvidia-modelopt"] == "0.47.0"
    assert all(len(h) == 64 for h in manifest["files"].values())


@pytest.mark.parametrize("precision", ["int8_sq", "int4_awq"])
def test_calibration_without_logits_is_the_same_calibration(precision, tiny_llama, tmp_path):
    """Calibration skips the logits of all positions but the last (lm_head is never quantized): the calibrated
    state is exactly what a forward pass with full logits gives."""
    import torch
    from conftest import compose

    from quantlab.artifacts import ArtifactStore
    from quantlab.env import resolve_device
    from quantlab.models import load_tokenizer
    from quantlab.precisions import describe, modelopt_config
    from quantlab.stages import data, prepare, quantize

    cfg, _ = compose([f"+precision={precision}", f"model.path={tiny_llama}", *FAST])
    store = ArtifactStore(tmp_path)
    ref = prepare.run(cfg.model, store)
    calib = data.run(cfg.calib, data.CALIB, ref.fingerprint, load_tokenizer(ref), store)
    block = 32 if precision == "int4_awq" else None
    req = quantize.QuantizeRequest(describe(cfg.precision, cfg.kv_cache, block),
                                   modelopt_config(cfg.precision, cfg.kv_cache, block), cfg.calib.batch_size)
    device = resolve_device("cpu")
    states = []
    for full in (False, True):
        torch.manual_seed(0)
        model, _ = quantize.calibrate(ref, calib, req, device, torch.float32, full_logits=full)
        states.append({k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)})
    assert states[0].keys() == states[1].keys()
    assert [k for k in states[0] if not torch.equal(states[0][k], states[1][k])] == []
