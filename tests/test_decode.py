"""Cached greedy decoding (quantlab.engines.decode) against what it replaces: the full-sequence forward re-run every
step. For every family of the support table (tiny trained models, fp32 on the CPU) and every format the torch engine
runs (real ModelOpt exports): the same greedy ids, each step's logits equal to the full forward's at that position,
the layers compiled once per layer kind with no graph break (dynamo traced on the CPU: the graphs and guards the GPU
compiles), FP8 KV stored in E4M3 and equal to the full-sequence quantize-dequantize, and the W4A16 Triton kernel
(run by Triton's CPU interpreter where Triton is installed) against the dequantized layer."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import FAST, _family_configs, run_api

from quantlab.engines import decode, fusion_fp8, qlayers
from quantlab.engines.base import Engine, Limits
from quantlab.engines.hf import HFModelEngine
from quantlab.errors import QuantlabError

PROMPT, NEW = 20, 12  # 20 prompt tokens + 12 new: past the tiny sliding windows (16)


def _prompts(batch=2, length=PROMPT, seed=3):
    return torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


def _load_family(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantlab.models import attn_implementation

    config = AutoConfig.from_pretrained(path)
    kwargs = {"dtype": torch.float32}
    if implementation := attn_implementation(config.to_dict()):
        kwargs["attn_implementation"] = implementation
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _step_logits_error(engine, prompts, ids) -> float:
    """Largest |cached - full| over the prefill's last position and every decode step, the steps reading the
    whole static cache under the mask exactly as the captured GPU step does; relative to the logits' scale."""
    seq = torch.cat([prompts, ids.to(prompts.device)], 1)
    with torch.no_grad():
        full = engine.forward(seq).logits(0, seq.shape[1])
    dec = decode.Decoder(engine.model, engine.head, engine.captured.take, seq.shape[0], seq.shape[1] + 1,
                         capture=False)
    p = prompts.shape[1]
    with torch.no_grad():
        worst = (dec._run(seq[:, :p], torch.arange(p), p) - full[:, p - 1]).abs().max().item()
        for j in range(p, seq.shape[1]):
            dec.pos.fill_(j)
            dec.tokens.copy_(seq[:, j:j + 1])
            worst = max(worst, (dec._run(dec.tokens, dec.pos, dec.max_len) - full[:, j]).abs().max().item())
    info = dec.describe()
    assert not dec.cache.window_mismatch, dec.cache.window_mismatch
    dec.close()
    return worst / max(1.0, full.abs().max().item()), info


def _compiled_ids(engine, prompts, steps=3):
    """Greedy ids from the decode step with its decoder layers compiled (dynamo, eager backend), the counters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    decode._COMPILED.clear()
    counters.clear()
    dec = decode.Decoder(engine.model, engine.head, engine.captured.take, prompts.shape[0],
                         prompts.shape[1] + steps + 2, capture=False, compile=True)
    dec.prefill(prompts)
    with torch.no_grad():
        for _ in range(steps):
            dec._step(dec.max_len, True)
            dec.position += 1
    ids = dec.out[:, prompts.shape[1]: prompts.shape[1] + steps + 1].clone()
    edges = len(dec.edges)  # (the fixture keeps QUANTLAB_COMPILE_EDGES on)
    dec.close()
    return ids, dict(counters["stats"]), dict(counters["graph_break"]), edges


@pytest.fixture
def eager_compile(monkeypatch):
    monkeypatch.setattr(decode, "COMPILE_BACKEND", "eager")
    monkeypatch.delenv("QUANTLAB_COMPILE_EDGES", raising=False)  # the graph counts include the edges
    yield
    torch._dynamo.reset()
    decode._COMPILED.clear()


@pytest.mark.parametrize("family", sorted(_family_configs()))
def test_cached_greedy_equals_full_recompute(family, family_model, eager_compile):
    model = _load_family(family_model(family))
    engine = HFModelEngine(model, Limits(256, 256, 8), family)
    prompts = _prompts()
    cached = engine.greedy(prompts, NEW)
    assert engine.forward_batches == NEW  # one prefill + NEW - 1 steps, counted as the re-run counted its passes
    full = Engine.greedy(engine, prompts, NEW)  # the re-run-everything greedy
    assert torch.equal(cached, full), (cached, full)
    info = engine.decode_info
    assert info["moe"] is (family in ("mixtral", "qwen3_moe"))
    assert not info["captured"]  # CUDA graphs on GPUs only (bench/decode.py --check captures every family)
    if family in ("mistral", "gemma2", "gemma3_text"):
        assert info["windows"] == [16]  # the prompts are longer than the window: it is exercised
    err, step_info = _step_logits_error(engine, prompts, cached)
    assert err < 1e-5, err
    if model.config._attn_implementation == "sdpa" and family not in ("gpt_neox", "opt"):
        assert "grouped sdpa" in step_info["attention"]  # GQA models read the cache once per step
    if info["moe"]:
        return  # routed experts read the routing on the host: not compiled or captured
    ids, stats, breaks, edges = _compiled_ids(engine, prompts)
    assert torch.equal(ids, full[:, :ids.shape[1]])
    assert not breaks, breaks
    # every decoder layer of a kind shares one compiled graph per shape - the prompt's (prefill) and the step's
    # (Gemma 2 / 3: sliding and full layers); so does each module outside the layers compiled with them (the final
    # norm, rotary embeddings; Gemma 3's one rotary embedding is called once per layer type), and the step's end
    # (argmax and writes) has one
    assert edges >= (1 if family == "opt" else 2)  # the final norm; the rotary embedding where the model has one
    edge_graphs = 2 * (edges + (family == "gemma3_text"))
    assert stats["unique_graphs"] == 2 * (2 if family in ("gemma2", "gemma3_text") else 1) + edge_graphs + 1, stats


@pytest.mark.parametrize("vocab", [128256, 49152, 32000, 151936, 256000, 6144, 4096])
def test_first_argmax_is_argmax_with_ties_and_nan(vocab):
    assert decode.argmax_chunks(vocab) >= 32  # the two-pass path (a vocabulary without chunks is one argmax)
    g = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        x = torch.randn(3, vocab, generator=g)
        if trial % 3 == 0:
            x = torch.round(x * 2) / 2  # many equal maxima
        if trial % 4 == 1:
            x[1, torch.randint(0, vocab, (3,), generator=g)] = float("nan")
        if trial % 5 == 2:
            x[2] = float("-inf")
        if trial % 6 == 3:
            x[0] = 1.0  # every value the maximum
        if trial % 7 == 4:
            x[1, -1] = x.max() + 1  # the maximum in the last chunk's last place
        assert torch.equal(decode.first_argmax(x), x.argmax(-1)), (vocab, trial)
    strided = torch.randn(vocab, 2, generator=g).t()  # a [2, V] view whose rows are not contiguous
    assert torch.equal(decode.first_argmax(strided), strided.argmax(-1))


def test_compiled_step_end_writes_what_the_eager_one_does():
    """decode.advance compiled by inductor (the CPU's code generator; the GPU's is checked by bench/decode.py --check
    through the captured steps): the same next token - ties, NaN and all -inf rows included - written to the same
    places, and the position moved on."""
    compiled = torch.compile(decode.advance, backend="inductor")
    g = torch.Generator().manual_seed(3)
    for trial in range(6):
        x = torch.randn(3, 4096, generator=g)
        if trial % 3 == 0:
            x = torch.round(x * 2) / 2  # many equal maxima
        if trial % 3 == 1:
            x[1, torch.randint(0, 4096, (3,), generator=g)] = float("nan")
            x[2] = float("-inf")
        if trial % 2 == 0:
            x[0] = 1.0  # every value the maximum
        written = []
        for fn in (decode.advance, compiled):
            tokens, out = torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 9, dtype=torch.long)
            pos = torch.tensor([4])
            fn(x, tokens, out, pos)
            written.append((tokens, out, pos))
        (tokens, out, pos), again = written
        assert torch.equal(tokens[:, 0], x.argmax(-1)) and torch.equal(out[:, 5], tokens[:, 0]) and pos.item() == 5
        assert all(torch.equal(a, b) for a, b in zip(written[0], again, strict=True)), (trial, written)


def test_first_argmax_chunks():
    """Llama-3's vocabulary in 501 runs of 256; SmolLM2's in 512 of 96; none where no 32-512 divisor leaves runs of
    64 (a prime, 1000, GPT-2's 50257, a vocabulary of 64)."""
    assert [decode.argmax_chunks(v) for v in (128256, 49152, 4096, 997, 1000, 50257, 64)] == [501, 512, 64, 0, 0, 0, 0]


def test_kv_layer_fp8_is_stored_in_e4m3_and_equals_qdq():
    g = torch.Generator().manual_seed(0)
    k_scale, v_scale = torch.tensor(0.02), torch.tensor(0.05)
    cache = decode.StaticKV(1, 10, {0: (k_scale, v_scale)})
    key, value = torch.randn(2, 3, 4, 8, generator=g) * 4, torch.randn(2, 3, 4, 8, generator=g) * 20  # saturates
    cache.positions, cache.read_length = torch.arange(4), 4
    k, v = cache.update(key, value, 0)
    assert cache.layers[0].keys.dtype == torch.uint8 and cache.layers[0].keys.shape == (2, 3, 10, 8)
    assert torch.equal(k, qlayers.fp8_qdq(key, k_scale)) and torch.equal(v, qlayers.fp8_qdq(value, v_scale))
    # a later write lands at its position and leaves the earlier ones as they were
    cache.positions, cache.read_length = torch.tensor([4]), 10
    k2, _ = cache.update(key[:, :, :1] * 0.5, value[:, :, :1], 0)
    assert torch.equal(k2[:, :, :4], k) and torch.equal(k2[:, :, 4:5], qlayers.fp8_qdq(key[:, :, :1] * 0.5, k_scale))
    assert torch.equal(k2[:, :, 5:], torch.zeros(2, 3, 5, 8))
    assert cache.nbytes() == 2 * 2 * 3 * 10 * 8  # one byte per value


def test_masks_follow_transformers_windows():
    cache = decode.StaticKV(1, 8)
    cache.positions, cache.read_length = torch.tensor([5]), 8
    cache.build_masks([None, 3], "sdpa", torch.float32)
    assert cache.masks[None][0, 0, 0].tolist() == [True] * 6 + [False] * 2
    assert cache.masks[3][0, 0, 0].tolist() == [False] * 3 + [True] * 3 + [False] * 2  # key > query - window
    cache.build_masks([None], "eager", torch.float16)
    row = cache.masks[None][0, 0, 0]
    assert row.dtype == torch.float16 and row[:6].eq(0).all() and row[6:].eq(torch.finfo(torch.float16).min).all()


def test_decoder_refuses_what_it_cannot_hold(tiny_llama):
    model = _load_family(tiny_llama)
    engine = HFModelEngine(model, Limits(32, 40, 2), "reference")
    with pytest.raises(QuantlabError, match="max_seq_len=40"):
        engine.greedy(_prompts(2, 30), 11)
    dec = decode.Decoder(model, engine.head, engine.captured.take, 2, 12, capture=False)
    dec.prefill(_prompts(2, 10))
    dec.step()
    with pytest.raises(ValueError, match="holds 12 positions"):
        dec.step()
    with pytest.raises(decode.Unsupported, match="graph capture needs one CUDA device"):
        decode.Decoder(model, engine.head, engine.captured.take, 2, 12, capture=True)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(decode.Unsupported, match="flex_attention"):
        decode.check_supported(model)


def test_prefill_whose_compilation_fails_runs_uncompiled(tiny_llama, monkeypatch, caplog):
    """A compiled prefill that fails (here: a compiler backend that refuses every graph) runs uncompiled with the
    same first tokens, says why, records it, and the steps run uncompiled too."""
    model = _load_family(tiny_llama)
    engine = HFModelEngine(model, Limits(64, 64, 2), "reference")
    prompts = _prompts(2, 10)
    plain = decode.Decoder(model, engine.head, engine.captured.take, 2, 14, capture=False)
    first = plain.prefill(prompts).clone()
    plain.close()

    def refuse(_gm, _inputs):
        raise RuntimeError("this backend compiles nothing")

    monkeypatch.setattr(decode, "COMPILE_BACKEND", refuse)
    torch._dynamo.reset()
    decode._COMPILED.clear()
    try:
        dec = decode.Decoder(model, engine.head, engine.captured.take, 2, 14, capture=False, compile=True)
        with caplog.at_level("WARNING", logger="quantlab"):
            assert torch.equal(dec.prefill(prompts), first)
        info = dec.describe()
        assert info["compiled"] is False and "compiles nothing" in info["compile_error"], info
        assert "compiling the layers failed" in caplog.text
        dec.step()  # uncompiled from here on
        assert dec.describe()["compiled"] is False
        dec.close()
    finally:
        torch._dynamo.reset()
        decode._COMPILED.clear()


EXPORTS = [("fp8", "fp8"), ("int8_sq", "none"), ("int4_awq", "fp8"), ("fp8_pc_pt", "none"), ("w4a8_awq", "none")]


@pytest.fixture(scope="module")
def exports(tiny_llama, tmp_path_factory, shared_cache):
    """Real ModelOpt exports of the tiny Llama, one per format the torch engine runs."""
    out = {}
    root = tmp_path_factory.mktemp("decode_exports")
    for precision, kv in EXPORTS:
        run_api([f"+precision={precision}", f"kv_cache={kv}", f"model.path={tiny_llama}", f"cache_dir={shared_cache}",
                 "stop_after=export", *FAST], root / f"run_{precision}")
        out[precision] = root / precision
        shutil.copytree((root / f"run_{precision}" / "checkpoint").resolve(), out[precision])
    return out


@pytest.mark.parametrize("precision,kv", EXPORTS)
def test_torch_engine_cached_decode(precision, kv, exports, eager_compile):
    from quantlab.engines.torch_engine import TorchEngine, load_exported
    from quantlab.env import resolve_device

    device = resolve_device("cpu")
    # float64: the cached and the full pass reduce in different orders (other GEMM shapes), and in float32 that
    # moves an activation across a dynamic FP8 / INT8 rounding boundary on some CPUs (1.3e-5 for fp8_pc_pt on an
    # EPYC with AVX-512 VP2INTERSECT, 2026-12-07): what is checked is the cache's arithmetic, not one machine's rounding
    model, plan = load_exported(exports[precision], device, torch.float64)
    if precision == "fp8":  # the GPU fuses shared inputs; the emulated path follows the same arithmetic
        assert fusion_fp8.fuse_shared_inputs(model, torch.float64) == 2 * model.config.num_hidden_layers
    engine = TorchEngine(model, Limits(256, 256, 8), device, plan)
    prompts = _prompts(seed=5)
    cached = engine.greedy(prompts, NEW)
    assert torch.equal(cached, Engine.greedy(engine, prompts, NEW))
    assert engine.decode_info["fp8_kv"] == (kv == "fp8")
    layers = model.config.num_hidden_layers
    kv_heads, head_dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    width = 1 if kv == "fp8" else 8  # E4M3 bytes, or the model's float64
    assert engine.decode_info["kv_cache_bytes"] == 2 * layers * 2 * kv_heads * (PROMPT + NEW) * head_dim * width
    err, _ = _step_logits_error(engine, prompts, cached)
    assert err < 1e-5, err
    ids, stats, breaks, edges = _compiled_ids(engine, prompts)
    assert torch.equal(ids, cached[:, :ids.shape[1]])
    # the prefill's shape and the step's, for the layers and each module compiled with them; the step's end
    assert not breaks and stats["unique_graphs"] == 2 + 2 * edges + 1, (stats, breaks)


def test_shared_quantize_is_matched_by_identity():
    """q/k/v handed one tensor share one quantize; a different tensor (even with equal values at the same storage)
    is quantized on its own; the held result is dropped once every sibling took it."""
    g = torch.Generator().manual_seed(1)
    shared = fusion_fp8.SharedActivation(torch.tensor(100.0), 3)
    x = torch.randn(2, 5, 8, generator=g)
    first = shared.quantize(x, x.reshape(-1, 8))
    assert shared.quantize(x, x.reshape(-1, 8)) is first
    view = x.view(2, 5, 8)  # same storage, another object: not taken for the held input
    other = shared.quantize(view, view.reshape(-1, 8))
    assert other is not first and torch.equal(other.float(), first.float())
    assert shared._held is not None and shared._held[0] is view
    shared.quantize(view, view.reshape(-1, 8))
    shared.quantize(view, view.reshape(-1, 8))
    assert shared._held is None


# ------------------------------------------------------------------------------------------------ W4A16 kernel
INTERPRETED = r"""
import json, torch
from modelopt.torch.export.quant_utils import pack_int4_in_uint8
from quantlab.engines import fusion_int4, qlayers
from quantlab.engines.kernels import int4

out = {"kernels": int4.check("cpu")}
g = torch.Generator().manual_seed(7)
n, k, block = 64, 256, 64
scale = torch.rand(n, k // block, generator=g) * 0.05 + 0.01
w = torch.randint(-8, 8, (n, k), generator=g).float() * scale.repeat_interleave(block, dim=1)
packed = pack_int4_in_uint8(w, scale, block)
pqs, bias = torch.rand(k, generator=g) + 0.5, torch.randn(n, generator=g)
plain = qlayers.Int4AwqLinear(packed, scale, block, pqs, bias, torch.float16)
out["layers"] = {}
for layout in ("export", "k8"):
    kept = qlayers.Int4AwqLinear(packed, scale, block, pqs, bias, torch.float16, packed_kernel=True)
    repacked = kept.repack() if layout == "k8" else False
    out["layers"][layout] = {
        "layout": kept.layout, "repacked": repacked, "no_dequantized_copy": kept.weight is None,
        "packed_bytes": kept.weight_packed.numel() * kept.weight_packed.element_size(),
        "same_weights": bool(torch.equal(kept.dequantized_weight(), plain.dequantized_weight())),
        "max_diff": max(float((kept(x).float() - plain(x).float()).abs().max())
                        for x in (torch.randn(2, r, k, generator=g).half() for r in (1, 5)))}

# q/k/v and gate|up of a tiny Llama fused into one packed GEMM each: the same logits, bit for bit
import transformers
from quantlab.engines.hf import HFModelEngine
from quantlab.engines.base import Limits
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2)).eval()
for name, m in list(model.named_modules()):
    if isinstance(m, torch.nn.Linear) and ".layers." in name:
        codes = torch.randint(0, 256, (m.out_features // 2, m.in_features), generator=g, dtype=torch.uint8)
        scales = torch.rand(m.out_features, m.in_features // 64, generator=g) * 0.02 + 2e-3
        smooth = torch.rand(m.in_features, generator=g) + 0.5 if name.endswith(("o_proj", "down_proj")) else None
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child,
                qlayers.Int4AwqLinear(codes, scales, 64, smooth, None, torch.float32, packed_kernel=True))
engine = HFModelEngine(model, Limits(64, 64, 2), "int4")
tokens = torch.randint(0, 500, (2, 9), generator=g)
export_logits = engine.logits(tokens)
repacked = fusion_int4.repack_int4(model)
before = engine.logits(tokens)
out["repack"] = {"layers": repacked, "max_diff": float((before - export_logits).abs().max())}
out["fusion"] = {"groups": fusion_int4.fuse_int4_siblings(model),
                 "mlp": type(model.model.layers[0].mlp).__name__,
                 "o_proj_pqs_in_op": [layer.self_attn.o_proj.pqs_in_op for layer in model.model.layers],
                 "same_logits": bool(torch.equal(before, engine.logits(tokens)))}
# gate|up rows interleaved for the gated epilogue (a GPU's one-row path): more rows take the output apart
for layer in model.model.layers:
    mlp = layer.mlp
    mlp.weight_packed, mlp.weight_scale = int4.interleave_gated(mlp.weight_packed, mlp.weight_scale)
    mlp.gated = True
out["interleaved_max_diff"] = float((before - engine.logits(tokens)).abs().max())
print("RESULT" + json.dumps(out))
"""


def test_int4_kernels_under_triton_interpreter():
    """The Triton W4A16 kernels (GEMV and GEMM) on the CPU under Triton's interpreter, in a fresh process (Triton
    reads TRITON_INTERPRET when triton.language is first imported): every case within its exact-arithmetic
    bound (int4.check); the layer the GPU builds (packed codes, the quantlab::w4a16_mm op) computing the
    dequantized layer's outputs from the same weights while holding N*K/2 bytes of codes; q/k/v and gate|up
    fused into one GEMM each giving the same logits bit for bit."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    bad = [c for c in out["kernels"] if not c["ok"]]
    assert not bad, bad
    ran = {c["kernel"] for c in out["kernels"]}
    assert ran == {"gemv", "gemm", "k8", "k8_dot_nosplit", "k8_fma_split", "k8_gemv_split", "k8_dense"}, ran
    assert any(c["kernel"] == "k8" and c["rows"] == 1 and c["k"] == 512 for c in out["kernels"])  # split over K
    for layout, layer in out["layers"].items():
        assert layer["layout"] == layout and layer["repacked"] == (layout == "k8"), layer
        assert layer["no_dequantized_copy"] and layer["packed_bytes"] == 64 * 256 // 2 and layer["same_weights"]
        assert layer["max_diff"] < 2e-2, layer  # fp16 outputs of |y| ~ 10: one fp16 rounding apart at most
    assert out["repack"]["layers"] == 14 and out["repack"]["max_diff"] < 1e-3, out["repack"]  # fp32: order only
    assert out["fusion"] == {"groups": 4, "mlp": "Int4GatedMLP", "o_proj_pqs_in_op": [True, True],
                             "same_logits": True}, out["fusion"]
    assert out["interleaved_max_diff"] < 1e-3, out  # fp32: rows in other tiles, the sums' order only


# ------------------------------------------------------------------------------------------------ FP8 GEMV
INTERPRETED_FP8 = r"""
import json, torch
from torch import nn
from quantlab.engines import fusion_fp8, qlayers
from quantlab.engines.kernels import fp8

out = {"kernels": fp8.check("cpu"), "usable": fp8.usable("cpu")}
g = torch.Generator().manual_seed(5)
k, n, inter = 256, 64, 96
cfg = {"block_n": 16, "block_k": 64, "split_k": 2, "num_warps": 4}
for shape in ((n, k), (2 * inter, k)):  # not down: its bf16 output needs the GPU
    fp8.CONFIGS[shape] = cfg


def layer(out_f, in_f):  # a native layer (torch._scaled_mm runs on the CPU too)
    return qlayers.Fp8Linear(fp8.codes((out_f, in_f), g, 0.25), torch.tensor(0.004), torch.tensor(0.02), None, True)


lin = layer(n, k)
holder = nn.ModuleDict({"lin": lin})
out["sent"] = fusion_fp8.use_fp8_gemv(holder)
diffs = {}
for dtype in (torch.float16, torch.float32):
    x = torch.randn(1, 1, k, generator=g).to(dtype) * 3
    lin.gemv = True
    y = lin(x)
    compiled = torch.compile(lambda t: lin(t), backend="eager", fullgraph=True)(x)
    lin.gemv = False
    ref = lin(x)
    xq = qlayers.fp8_quantize(x.reshape(1, k), lin.inv_input_scale)
    exact, bound = fp8.bound(xq, lin.weight, float(lin.input_scale * lin.weight_scale), dtype)
    diffs[str(dtype)] = {"kernel_vs_exact": float(((y.reshape(1, n).double() - exact).abs() / bound).max()),
                         "scaled_mm_vs_kernel": float((ref - y).abs().max() / ref.abs().max()),
                         "compiled_equal": bool(torch.equal(compiled, y))}
out["layer"] = diffs

# gate|up (fp32 accumulators, unit scales) through the kernel inside Fp8GatedMLP: the same MLP output as cuBLAS's
gate, up, down = layer(inter, k), layer(inter, k), layer(k, inter)
gate.inv_input_scale = up.inv_input_scale
gate.input_scale = up.input_scale
mlp = fusion_fp8.Fp8GatedMLP(gate, up, down)
mlp.fp32_gemm = True
holder = nn.ModuleDict({"mlp": mlp})
x = torch.randn(1, 1, k, generator=g).bfloat16()
ref = mlp(x)
out["mlp_sent"] = fusion_fp8.use_fp8_gemv(holder)
y = mlp(x)
xq = qlayers.fp8_quantize(x.reshape(1, k), mlp.inv_input_scale)
acc = torch.ops.quantlab.fp8_gemv(xq, mlp.weight, mlp.one, mlp.one, torch.float32)
exact, bound = fp8.bound(xq, mlp.weight, 1.0, torch.float32)
out["mlp"] = {"gemv": mlp.gemv, "acc_vs_exact": float(((acc.double() - exact).abs() / bound).max()),
              "rel_diff": float((y - ref).float().abs().max() / ref.float().abs().max())}
print("RESULT" + json.dumps(out))
"""


def test_fp8_gemv_under_triton_interpreter():
    """The one-row FP8 GEMV (quantlab::fp8_gemv) on the CPU under Triton's interpreter, in a fresh process: every
    case and configuration (no split, splits, unrolled, N not a multiple of the tile, 3 rows; fp16 out with the two
    scales, fp32 out with unit scales) within its bound of the exact float64 arithmetic; the startup check passes;
    use_fp8_gemv sends a native layer with a configured shape to the kernel, whose output matches the exact
    arithmetic and torch._scaled_mm's (to rounding order), also traced by torch.compile; the fused gate|up GEMM of
    Fp8GatedMLP through the kernel gives the MLP's output."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", INTERPRETED_FP8], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    bad = [c for c in out["kernels"] if not c["ok"]]
    assert not bad, bad
    assert {c["kernel"] for c in out["kernels"]} == {"n32_k128_nosplit", "n16_k64_split", "n64_k32_split_max",
                                                     "n32_k64_unrolled", "default"}
    assert out["usable"] and out["sent"] == 1
    for dtype, d in out["layer"].items():
        assert d["kernel_vs_exact"] <= 1.0 and d["compiled_equal"], (dtype, d)
        assert d["scaled_mm_vs_kernel"] < (2e-3 if "16" in dtype else 1e-5), (dtype, d)
    assert out["mlp_sent"] == 1 and out["mlp"]["gemv"] and out["mlp"]["acc_vs_exact"] <= 1.0, out
    assert out["mlp"]["rel_diff"] < 2e-2, out["mlp"]  # an fp8 requantization may flip one step: bf16 output


# ------------------------------------------------------------------------------------------------ decode attention
INTERPRETED_ATTENTION = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM
from quantlab.engines import decode
from quantlab.engines.base import Engine, Limits
from quantlab.engines.hf import HFModelEngine
from quantlab.engines.kernels import attention
from quantlab.models import attn_implementation

paths, exports = json.loads(sys.argv[1]), json.loads(sys.argv[2])
decode.COMPILE_BACKEND = "eager"
out = {"kernel": attention.check("cpu"), "families": {}}
prompts = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(3))


def step_error(engine, ids):
    # each decode step's logits (the kernel reading the whole static cache up to the position) vs the full forward
    seq = torch.cat([prompts, ids], 1)
    with torch.no_grad():
        full = engine.forward(seq).logits(0, seq.shape[1])
    dec = decode.Decoder(engine.model, engine.head, engine.captured.take, 2, seq.shape[1] + 1, capture=False)
    worst = 0.0
    with torch.no_grad():
        dec._run(seq[:, :20], torch.arange(20), 20)
        for j in range(20, seq.shape[1]):
            dec.pos.fill_(j)
            dec.tokens.copy_(seq[:, j:j + 1])
            worst = max(worst, (dec._run(dec.tokens, dec.pos, dec.max_len) - full[:, j]).abs().max().item())
    info = dec.describe()
    dec.close()
    return worst / max(1.0, full.abs().max().item()), info


def compiled(engine):
    torch._dynamo.reset()
    decode._COMPILED.clear()
    counters.clear()
    dec = decode.Decoder(engine.model, engine.head, engine.captured.take, 2, 26, capture=False, compile=True)
    dec.prefill(prompts)
    with torch.no_grad():
        for _ in range(3):
            dec._step(dec.max_len, True)
            dec.position += 1
    ids = dec.out[:, 20:24].clone()
    extra = 2 * len(dec.edges) + 1 if dec.edges is not None else 0  # the edges' graphs and the step end's
    dec.close()
    return ids, counters["stats"]["unique_graphs"] - extra, dict(counters["graph_break"])


def run(name, engine, compile_too):
    cached = engine.greedy(prompts, 12)
    row = {"ids_equal": bool(torch.equal(cached, Engine.greedy(engine, prompts, 12))),
           "paths": engine.decode_info["attention"], "kernel_modules": engine.decode_info["attention_kernel_modules"]}
    row["step_err"], info = step_error(engine, cached)
    row["step_paths"] = info["attention"]
    if compile_too:
        ids, graphs, breaks = compiled(engine)
        row["compiled"] = {"ids_equal": bool(torch.equal(ids, cached[:, :4])), "graphs": graphs, "breaks": breaks}
    out["families"][name] = row


for name, path in paths.items():
    config = AutoConfig.from_pretrained(path)
    kwargs = {"dtype": torch.float32}
    if implementation := attn_implementation(config.to_dict()):
        kwargs["attn_implementation"] = implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    run(name, HFModelEngine(model, Limits(256, 256, 8), name), name in ("llama", "gemma2"))

from quantlab.engines.torch_engine import TorchEngine, load_exported
from quantlab.env import resolve_device
device = resolve_device("cpu")
for name, path in exports.items():
    model, plan = load_exported(path, device, torch.float32)
    run(name, TorchEngine(model, Limits(256, 256, 8), device, plan), True)
print("RESULT" + json.dumps(out))
"""


def test_decode_attention_kernel_under_triton_interpreter(family_model, exports):
    """The Triton decode-attention kernel under Triton's interpreter, in a fresh process: against its reference
    (GQA and MHA, sliding window, soft-capping, E4M3 cache, one split and several); then standing in for every
    family's attention in the cached decode (sdpa and the eager Gemma 2 / 3 with their windows and soft-capping,
    and an FP8 KV export read as E4M3 bytes): the same greedy ids as the full re-run, each step's logits equal to
    the full forward's, the layers traced by dynamo through the op in one graph with no break."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    paths = {family: str(family_model(family)) for family in sorted(_family_configs())}
    fp8_kv = {"fp8_kv": str(exports["fp8"])}  # the fp8 export carries kv_cache=fp8
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", INTERPRETED_ATTENTION, json.dumps(paths), json.dumps(fp8_kv)],
                         env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    layers = {}  # every attention layer of each model runs the kernel (the Gemma 2 / 3 models have 4, others 2)
    for name, path in {**paths, **fp8_kv}.items():
        config = json.loads((Path(path) / "config.json").read_text())
        layers[name] = (config.get("text_config") or config)["num_hidden_layers"]
    bad = [c for c in out["kernel"] if not c["ok"]]
    assert not bad, bad
    assert {c["splits"] > 1 for c in out["kernel"]} == {True, False}  # the combine and the single-split store
    for name, row in out["families"].items():
        assert row["ids_equal"], (name, row)
        assert row["step_err"] < 1e-5, (name, row)
        assert row["kernel_modules"] == layers[name] and "triton decode attention" in row["step_paths"], (name, row)
        if "compiled" in row:
            # the prefill's shape and the step's, per layer kind (the compiled modules outside the layers and the
            # step's end counted apart)
            graphs = 2 * (1 + (name == "gemma2"))
            assert row["compiled"] == {"ids_equal": True, "graphs": graphs, "breaks": {}}, (name, row)
    assert set(out["families"]) == set(paths) | set(fp8_kv)


def test_speed_measurement_pairs_rounds_and_reports_intervals(tiny_llama):
    """quantlab.engines.speed on the CPU (uncaptured: the structure, not the speed, is checked here; the GPU figures
    are bench/decode.py's and a GPU run's metrics.json): paired rounds of both engines' cached decode, each batch's
    medians inside their ranges, the speedup's interval around its median, KV and weight bytes of what is held.
    The same model as candidate and reference gives equal bytes."""
    import types

    from quantlab.engines import speed

    engines = [HFModelEngine(_load_family(tiny_llama), Limits(256, 256, 4), name)
               for name in ("candidate", "reference")]
    out = speed.measure(engines[0], engines[1], types.SimpleNamespace(name="cpu"), batches=(1, 2), capture=False)
    assert out["measured"] and [b["batch"] for b in out["batches"]] == [1, 2]
    assert out["weights_bytes"]["candidate"] == out["weights_bytes"]["reference"] > 0
    for b in out["batches"]:
        assert b["rounds"] == speed.ROUNDS and b["captured"] == {"candidate": False, "reference": False}
        assert b["compiled"] == {"candidate": False, "reference": False}  # the generations' path (HFModelEngine)
        for side in ("candidate", "reference"):
            d = b["decode_ms_per_token"][side]
            assert 0 < d["min"] <= d["median"] <= d["max"]
            assert b["prefill_tokens_per_s"][side] > 0 and b["kv_cache_bytes"][side] > 0
        s = b["decode_speedup"]
        assert s["ci"][0] <= s["value"] <= s["ci"][1]
    assert out["batches"][1]["kv_cache_bytes"]["candidate"] == 2 * out["batches"][0]["kv_cache_bytes"]["candidate"]
    assert out["path"] == "uncompiled layers, the path of the generations, steps not captured"
    assert out["path"] in speed.describe(out)
    assert "speed on cpu" in speed.describe(out) and "not measured (why)" in speed.describe(speed.not_measured("why"))
