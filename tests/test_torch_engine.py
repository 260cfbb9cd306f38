"""engine=torch: each quantized layer vs a float64 computation of the same math (fresh random inputs every run),
real exported checkpoints vs ModelOpt fake-quant, and corrupted checkpoints named by tensor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import FAST, read_json, run_api, run_cli
from safetensors.torch import load_file, save_file

from quantlab.engines import fusion_fp8, qlayers
from quantlab.engines.torch_engine import load_exported
from quantlab.env import resolve_device
from quantlab.errors import QuantlabError


def _rng(seed: int = 0):
    """A seeded generator: a failure reproduces (torch.seed() would also reseed the global generator)."""
    return torch.Generator().manual_seed(seed)


def test_fp8_linear_matches_float64_math():
    g = _rng()
    n, k = 48, 64
    w = torch.randn(n, k, generator=g)
    ws = w.abs().max() / 448
    w8 = (w / ws).clamp(-448, 448).to(torch.float8_e4m3fn)
    x = torch.randn(5, 7, k, generator=g) * 3
    xs = torch.tensor(2.0 / 448)  # deliberately small: values beyond it must saturate, not become NaN
    b = torch.randn(n, generator=g)
    layer = qlayers.Fp8Linear(w8, ws, xs, b, native=False)
    y = layer(x)
    # the quantize step is defined in fp32 (x * (1/scale)); only the accumulation is done in float64 here
    xq = (x * (1.0 / xs)).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    ref = (xq @ w8.double().t()) * xs.double() * ws.double() + b.double()
    assert torch.isfinite(y).all()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_fp8_per_channel_per_token_linear_matches_float64_math():
    g = _rng()
    n, k = 40, 64
    w = torch.randn(n, k, generator=g)
    ws = w.abs().amax(1) / 448  # one scale per output channel
    w8 = (w / ws[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(3, 5, k, generator=g) * torch.rand(3, 5, 1, generator=g) * 4
    x[0, 0] = 0.0  # an all-zero token keeps scale 1 (ModelOpt's convention), and stays zero
    layer = qlayers.Fp8PcPtLinear(w8, ws, None, native=False)
    amax = x.abs().amax(-1, keepdim=True)
    inv = 448.0 / torch.where(amax <= 2**-24, torch.ones_like(amax), amax)
    xq = (x * inv).clamp(-448, 448).to(torch.float8_e4m3fn).double()  # per-token quantize, as defined, in fp32
    ref = (xq / inv.double()) @ (w8.double() * ws.double()[:, None]).t()
    assert torch.allclose(layer(x).double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(layer(x)[0, 0], torch.zeros(n))


def test_int8_sq_linear_matches_float64_math():
    g = _rng()
    n, k = 40, 64
    w8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-3
    pqs = torch.rand(k, generator=g) + 0.5
    xs = torch.tensor(0.03)
    x = torch.randn(3, 9, k, generator=g)
    layer = qlayers.Int8SqLinear(w8, ws, xs, pqs, None)
    xq = torch.round((x * pqs) * (1.0 / xs)).clamp(-128, 127).double()  # quantize as defined, in fp32
    ref = (xq @ w8.double().t()) * xs.double() * ws.double()
    assert torch.allclose(layer(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_int4_unpack_matches_modelopt_packing_and_layer_math():
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    g = _rng()
    n, k, block = 32, 128, 32
    scale = torch.rand(n, k // block, generator=g) + 0.1
    q = torch.randint(-8, 8, (n, k), generator=g).float()
    w = q * scale.repeat_interleave(block, dim=1)
    packed = pack_int4_in_uint8(w, scale, block)  # ModelOpt's own packer is the reference for the layout
    assert torch.equal(qlayers.unpack_int4(packed), q.to(torch.int8))
    pqs = torch.rand(k, generator=g) + 0.5
    # float64 compute: the check is on unpacking, group scales and pre_quant_scale, not fp32 accumulation noise
    layer = qlayers.Int4AwqLinear(packed, scale, block, pqs, None, torch.float64)
    x = torch.randn(4, k, generator=g)
    ref = (x.double() * pqs.double()) @ w.double().t()
    assert torch.allclose(layer(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_fp8_kv_qdq_round_trip():
    g = _rng()
    x = torch.randn(2, 3, 16, 8, generator=g)
    scale = x.abs().max() / 448
    y = qlayers.fp8_qdq(x, scale)
    assert torch.equal(y, x.div(scale).to(torch.float8_e4m3fn).float() * scale)
    assert (y - x).abs().max() <= x.abs().max() * 2**-3  # E4M3 keeps 3 mantissa bits


ENGINE_CASES = [("llama", "fp8", "none"), ("llama", "fp8", "fp8"), ("llama", "int8_sq", "none"),
                ("llama", "int4_awq", "fp8"), ("qwen2", "fp8", "none"), ("qwen2", "int8_sq", "fp8"),
                ("qwen2", "int4_awq", "none"), ("qwen2", "fp8_pc_pt", "fp8")]


@pytest.mark.parametrize("family,precision,kv", ENGINE_CASES)
def test_engine_agrees_with_fakequant(family, precision, kv, request, tmp_path, shared_cache):
    model_dir = request.getfixturevalue(f"tiny_{family}")
    extra = ["precision.block_size=32"] if precision == "int4_awq" and family == "qwen2" else []
    run_api([f"+precision={precision}", f"kv_cache={kv}", f"model.path={model_dir}", f"cache_dir={shared_cache}",
             "engine=torch", "eval.attribution=true", *FAST, *extra], tmp_path)
    doc = read_json(tmp_path / "metrics.json")
    att = doc["attribution"]
    # The engine runs what export wrote; export itself re-smooths shared-input layers (AWQ / SQ), so the
    # engine is compared with the fake-quant model after that same transformation.
    assert att["engine_vs_exported_top1"] >= min(0.99, att["exported_jitter_floor_top1"]), att
    fq, en = att["metrics"]["kl_mean"]["fakequant_exported"], att["metrics"]["kl_mean"]["torch"]
    assert abs(en - fq) <= 0.1 * fq + 1e-3, att
    for metric in ("dnll_mean", "kl_mean"):
        m = att["metrics"][metric]
        assert m["quantization"] + m["export"] + m["engine"] == pytest.approx(m["torch"], abs=1e-9)
    assert doc["run"]["engine"] == "torch"


def _export(tiny_llama, tmp_path, cache, kv="fp8"):
    run_api(["+precision=fp8", f"kv_cache={kv}", f"model.path={tiny_llama}", f"cache_dir={cache}", "stop_after=export",
             *FAST], tmp_path / "export_run")
    src = (tmp_path / "export_run" / "checkpoint").resolve()
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    (dst / "manifest.json").unlink()
    return dst


def _rewrite(ckpt, change):
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f))


@pytest.mark.parametrize("damage,message", [
    ("missing_scale", "missing tensor model.layers.1.mlp.down_proj.weight_scale"),
    ("wrong_dtype", "tensor model.layers.0.self_attn.q_proj.weight"),
    ("missing_kv_scale", "missing tensor model.layers.0.self_attn.k_proj.k_scale"),
    ("zero_scale", "model.layers.0.mlp.up_proj.input_scale holds non-positive"),
    ("truncated", "truncated or corrupt"),
])
def test_corrupted_checkpoint_is_named(damage, message, tiny_llama, tmp_path, shared_cache):
    ckpt = _export(tiny_llama, tmp_path, shared_cache)
    if damage == "missing_scale":
        _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale"))
    elif damage == "wrong_dtype":
        _rewrite(ckpt, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight":
                                           t["model.layers.0.self_attn.q_proj.weight"].float().half()}))
    elif damage == "missing_kv_scale":
        _rewrite(ckpt, lambda t: t.pop("model.layers.0.self_attn.k_proj.k_scale"))
    elif damage == "zero_scale":
        _rewrite(ckpt, lambda t: t.update({"model.layers.0.mlp.up_proj.input_scale": torch.tensor(0.0)}))
    else:
        f = ckpt / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-4096])
    with pytest.raises(QuantlabError, match=message.replace(".", r"\.")):
        load_exported(ckpt, resolve_device("cpu"), torch.float32)
    res = run_cli(["+precision=fp8", "kv_cache=fp8", f"model.path={tiny_llama}", f"engine.checkpoint={ckpt}", *FAST,
                   "hydra.run.dir=outputs/r"], cwd=tmp_path, cache=shared_cache)
    if damage == "truncated":  # not a readable checkpoint at all: bad input
        assert res.returncode == 2, res.stderr[-2000:]
        assert message in res.stderr
        return
    # a readable but broken checkpoint fails its audit before any evaluation: exit 1, the tensor named in the report
    assert res.returncode == 1, res.stderr[-2000:]
    assert "checkpoint audit found" in res.stdout and not (tmp_path / "outputs" / "r" / "metrics.json").exists()
    report = json.loads((tmp_path / "outputs" / "r" / "audit.json").read_text())
    assert any(message in f["message"] for f in report["findings"]), report["findings"]


def test_external_checkpoint_evaluates_and_must_match_the_recipe(tiny_llama, tmp_path, shared_cache):
    ckpt = _export(tiny_llama, tmp_path, shared_cache, kv="none")
    assert run_api(["+precision=fp8", f"model.path={tiny_llama}", f"cache_dir={shared_cache}",
                    f"engine.checkpoint={ckpt}", *FAST], tmp_path / "ok") in (0, 1)
    doc = read_json(tmp_path / "ok" / "metrics.json")
    assert doc["run"]["checkpoint"]["external"] is True
    with pytest.raises(QuantlabError, match="the run asks for W8A8_SQ_PER_CHANNEL"):
        run_api(["+precision=int8_sq", f"model.path={tiny_llama}", f"cache_dir={shared_cache}",
                 f"engine.checkpoint={ckpt}", *FAST], tmp_path / "bad")


def test_build_limits_are_enforced_and_recorded(tiny_llama, tmp_path, shared_cache):
    from quantlab.engines.base import Limits

    limits = Limits(max_input_len=32, max_seq_len=40, max_batch_size=2)
    with pytest.raises(QuantlabError, match="max_batch_size=2"):
        limits.check(3, 16)
    with pytest.raises(QuantlabError, match="max_input_len=32"):
        limits.check(1, 33)
    with pytest.raises(QuantlabError, match="max_seq_len=40"):
        limits.check(1, 32, new_tokens=9)
    run_api(["+precision=fp8", f"model.path={tiny_llama}", f"cache_dir={shared_cache}", "engine.max_seq_len=128",
             *FAST], tmp_path)
    record = read_json(tmp_path / "run.json")
    assert record["engine"]["limits"] == {"max_input_len": 128, "max_seq_len": 128, "max_batch_size": 64}
    engines = [json.loads(p.read_text()) for p in shared_cache.glob("engine/*/engine.json")]
    assert any(e["limits"]["max_seq_len"] == 128 for e in engines)


def test_shared_input_fusion_matches_separate_layers(tiny_llama, tmp_path, shared_cache):
    """ModelOpt's FP8 export gives q/k/v (and gate/up) one input scale, so the engine quantizes their shared
    activation once and runs gate/up as one GEMM with the SiLU product and down's quantize in one pass; the
    outputs equal the separate layers' (checked in the emulated path, which follows the native arithmetic)."""
    ckpt = _export(tiny_llama, tmp_path, shared_cache, kv="none")
    device = resolve_device("cpu")
    separate, _ = load_exported(ckpt, device, torch.float32)
    fused_model, _ = load_exported(ckpt, device, torch.float32)
    groups = fusion_fp8.fuse_shared_inputs(fused_model, torch.float32)
    layers = fused_model.config.num_hidden_layers
    assert groups == 2 * layers  # q/k/v and the MLP in every layer: export unified their input scales
    assert isinstance(fused_model.model.layers[0].mlp, fusion_fp8.Fp8GatedMLP)
    assert fused_model.model.layers[0].self_attn.k_proj.shared is fused_model.model.layers[0].self_attn.q_proj.shared
    tokens = torch.randint(0, fused_model.config.vocab_size, (2, 40), generator=_rng())
    calls = []
    original = qlayers.fp8_quantize
    qlayers.fp8_quantize = lambda *a: calls.append(1) or original(*a)
    try:
        with torch.no_grad():
            b = fused_model(tokens).logits
            per_forward_fused = len(calls)
            a = separate(tokens).logits
    finally:
        qlayers.fp8_quantize = original
    assert per_forward_fused == 3 * layers  # q/k/v once, o once, gate/up once (down's is in silu_mul_quantize)
    assert len(calls) - per_forward_fused == 7 * layers
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    with torch.inference_mode():  # inference tensors carry no version counter: the shared quantize still works
        assert torch.equal(fused_model(tokens).logits, b)
    # native GEMMs in an fp32 model: the MLP is left alone (row-wise scaled FP8 GEMMs write bf16)
    native_fp32, _ = load_exported(ckpt, device, torch.float32)
    for m in native_fp32.modules():
        if isinstance(m, qlayers.Fp8Linear):
            m.native = True
    assert fusion_fp8.fuse_shared_inputs(native_fp32, torch.float32) == layers


def test_engine_device_map_places_and_matches(tiny_llama, tmp_path, shared_cache):
    """model.device_map reaches the torch engine: accelerate plans the placement and dispatches the model
    (here every block lands on the CPU; on 2 GPUs the layers split, bench/RESULTS.md); logits are unchanged."""
    ckpt = _export(tiny_llama, tmp_path, shared_cache, kv="fp8")
    device = resolve_device("cpu")
    plain, _ = load_exported(ckpt, device, torch.float32)
    mapped, plan = load_exported(ckpt, device, torch.float32, "auto")
    assert plan["devices"] == ["cpu"]
    tokens = torch.randint(0, plain.config.vocab_size, (2, 24), generator=_rng())
    with torch.no_grad():
        assert torch.equal(plain(tokens).logits, mapped(tokens).logits)
    with pytest.raises(QuantlabError, match="device_map='everywhere' is not supported"):
        load_exported(ckpt, device, torch.float32, "everywhere")
