"""Checkpoints made by other tools (quantlab.formats): each format built here from a tiny random Llama with a packer
written in this file from the format's documented layout (independent of quantlab's packing code), or with the gguf
package for GGUF. quantlab must detect the format from the files, its engine's logits must equal those of the
reference model carrying the independently dequantized weights (and the format's activation quantization, written
here too), healthy checkpoints must pass the audit and damaged ones fail it, and layouts quantlab does not read must
exit 2 naming what was found. Nothing here reads files outside the test's temporary directory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, LAYERS, VOCAB = 4, 2, 16, 64, 128, 2, 512  # VOCAB: conftest's tokenizer
GROUP = 32
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


# --------------------------------------------------------------------------------------- the tiny reference
@pytest.fixture(scope="module")
def reference(tmp_path_factory, tok_dir) -> Path:
    """A random tiny Llama (tied embeddings), saved as safetensors beside conftest's small BPE tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))  # not all ones: a dropped norm must show
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    out = tmp_path_factory.mktemp("formats") / "ref"
    model.save_pretrained(out, safe_serialization=True)
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def _ref_model(reference: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()


def _linear_weights(reference: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = load_file(str(reference / "model.safetensors"))
    return {k.removesuffix(".weight"): v for k, v in sd.items() if any(k.endswith(f"{n}.weight") for n in LINEARS)}


def _plain_tensors(reference: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = load_file(str(reference / "model.safetensors"))
    return {k: v for k, v in sd.items() if not any(k.endswith(f"{n}.weight") for n in LINEARS)}


def _save(out: Path, reference: Path, tensors: dict, quantization_config: dict) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((reference / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


# --------------------------------------------------------------------------------------- independent packers
def pack_fields(codes: np.ndarray, bits: int, order=None) -> np.ndarray:
    """Unsigned codes [R, C] -> int32 words [R, C * bits / 32]: field k of a word at bit k * bits holds column
    order[k] of its run (default: column k), written with Python integers one word at a time."""
    per = 32 // bits
    rows, cols = codes.shape
    order = list(order) if order is not None else list(range(per))
    out = np.zeros((rows, cols // per), dtype=np.uint32)
    for r in range(rows):
        for w in range(cols // per):
            word = 0
            for k in range(per):
                word |= int(codes[r, w * per + order[k]]) << (bits * k)
            out[r, w] = word
    return out.view(np.int32)


def unpack_fields(words: np.ndarray, bits: int, order=None) -> np.ndarray:
    """The inverse of pack_fields, by the same one-word-at-a-time reading."""
    per = 32 // bits
    order = list(order) if order is not None else list(range(per))
    u = words.view(np.uint32)
    out = np.zeros((u.shape[0], u.shape[1] * per), dtype=np.int64)
    for k in range(per):
        out[:, np.arange(u.shape[1]) * per + order[k]] = (u >> (bits * k)) & ((1 << bits) - 1)
    return out


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


# --------------------------------------------------------------------------------------- compressed-tensors
def _ct_config(fmt: str, weights: dict, acts: dict | None, kv: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "weights": weights,
                                          "input_activations": acts, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": kv, "sparsity_config": {}, "transform_config": {},
            "version": "0.19.0"}


def _weight_args(bits, kind, strategy, symmetric, group=None):
    return {"num_bits": bits, "type": kind, "strategy": strategy, "symmetric": symmetric, "group_size": group,
            "dynamic": False, "actorder": None, "observer": "minmax", "block_structure": None}


def build_ct_fp8(reference: Path, out: Path):
    """FP8 E4M3 weights with a per-channel scale, FP8 activations per token at run time (FP8_DYNAMIC)."""
    tensors, deq = _plain_tensors(reference), {}
    for name, w in _linear_weights(reference).items():
        s = w.abs().amax(dim=1, keepdim=True) / 448.0
        q = (w / s).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q, s
        deq[name] = q.float() * s
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    return _save(out, reference, tensors, _ct_config("float-quantized", _weight_args(8, "float", "channel", True),
                                                     acts)), deq, "fp8"


def build_ct_w8a8(reference: Path, out: Path):
    """INT8 weights per channel, INT8 activations per token at run time (W8A8)."""
    tensors, deq = _plain_tensors(reference), {}
    for name, w in _linear_weights(reference).items():
        s = w.abs().amax(dim=1, keepdim=True) / 127.0
        q = torch.clamp(torch.round(w / s), -128, 127).to(torch.int8)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q, s
        deq[name] = q.float() * s
    acts = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    return _save(out, reference, tensors, _ct_config("int-quantized", _weight_args(8, "int", "channel", True),
                                                     acts)), deq, "int8"


def pack_w4a16(weights: dict, tensors: dict, symmetric: bool) -> dict:
    """pack-quantized int4 of these weights into tensors, group GROUP: codes q in [-8, 7] stored as q + 8, eight per
    int32 along the input dimension; asymmetric zero points (also + 8) packed along the output dimension. Returns
    the dequantized weights."""
    deq = {}
    for name, w in weights.items():
        rows, cols = w.shape
        g = w.reshape(rows, cols // GROUP, GROUP)
        if symmetric:
            s = g.abs().amax(-1) / 7.5
            z = torch.zeros_like(s)
        else:
            lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
            s = (hi - lo) / 15
            z = torch.clamp(torch.round(-8 - lo / s), -8, 7)
        q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], -8, 7).reshape(rows, cols)
        tensors[f"{name}.weight_packed"] = _t(pack_fields((q + 8).long().numpy(), 4))
        tensors[f"{name}.weight_scale"] = s
        tensors[f"{name}.weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
        if not symmetric:
            tensors[f"{name}.weight_zero_point"] = _t(pack_fields((z + 8).long().numpy().T, 4).T)
        deq[name] = ((q.reshape(rows, cols // GROUP, GROUP) - z[..., None]) * s[..., None]).reshape(rows, cols)
    return deq


def build_ct_w4a16(reference: Path, out: Path, symmetric: bool):
    """pack-quantized int4, group 32 (pack_w4a16)."""
    tensors = _plain_tensors(reference)
    deq = pack_w4a16(_linear_weights(reference), tensors, symmetric)
    args = _weight_args(4, "int", "group", symmetric, GROUP)
    return _save(out, reference, tensors, _ct_config("pack-quantized", args, None)), deq, None


# --------------------------------------------------------------------------------------- GPTQ / AWQ
AWQ_INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)  # field k of an AWQ GEMM word holds column AWQ_INTERLEAVE[k] of its 8


def build_gptq(reference: Path, out: Path, act_order: bool, v2: bool = False):
    """GPTQ, 4 bit, group 32, F16 scales: qweight [in/8, out] packed along the input dimension, qzeros [groups, out/8]
    along the output dimension; v1 (format gptq): symmetric, zero 8 stored as z - 1 = 7; v2 (format gptq_v2):
    asymmetric, zero points stored as they are. With act-order a g_idx assigns every input column to a group (32
    members each, not column // 32)."""
    gen = torch.Generator().manual_seed(1)
    tensors, deq = {k: v.to(torch.bfloat16) for k, v in _plain_tensors(reference).items()}, {}
    for name, w in _linear_weights(reference).items():
        rows, cols = w.shape
        groups = cols // GROUP
        g_idx = torch.empty(cols, dtype=torch.int64)
        g_idx[torch.randperm(cols, generator=gen) if act_order else torch.arange(cols)] = \
            torch.arange(cols) // GROUP
        wt = w.t()  # [in, out]
        if v2:
            lo = torch.stack([wt[g_idx == g].amin(0) for g in range(groups)]).clamp(max=0)
            hi = torch.stack([wt[g_idx == g].amax(0) for g in range(groups)]).clamp(min=0)
            s = ((hi - lo) / 15).to(torch.float16)  # [groups, out]
            z = torch.clamp(torch.round(-lo / s.float()), 0, 15).long()
        else:
            s = torch.stack([wt[g_idx == g].abs().amax(0) / 7 for g in range(groups)]).to(torch.float16)
            z = torch.full((groups, rows), 8, dtype=torch.int64)
        q = torch.clamp(torch.round(wt / s[g_idx].float()) + z[g_idx], 0, 15).long()  # [in, out] unsigned
        tensors[f"{name}.qweight"] = _t(pack_fields(q.numpy().T, 4).T)
        tensors[f"{name}.qzeros"] = _t(pack_fields((z if v2 else z - 1).numpy(), 4))
        tensors[f"{name}.scales"] = s
        if act_order:
            tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
        deq[name] = ((q - z[g_idx]).to(torch.float16) * s[g_idx]).t().float()  # the format's kernels: f16
    layout = "gptq_v2" if v2 else "gptq"
    qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": not v2,
          "format": layout, "checkpoint_format": layout, "pack_dtype": "int32", "lm_head": False,
          "meta": {"quantizer": ["test-packer"]}}
    return _save(out, reference, tensors, qc), deq, None


def build_awq(reference: Path, out: Path):
    """AWQ GEMM, 4 bit asymmetric, group 32: qweight [in, out/8] and qzeros [groups, out/8] interleaved
    (0, 2, 4, 6, 1, 3, 5, 7), zero points as they are, F16 scales; labelled as GPTQModel labels it (quant_method
    gptq, format gemm)."""
    tensors, deq = {k: v.to(torch.bfloat16) for k, v in _plain_tensors(reference).items()}, {}
    for name, w in _linear_weights(reference).items():
        rows, cols = w.shape
        g = w.t().reshape(cols // GROUP, GROUP, rows)  # [groups, 32, out]
        lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
        s = ((hi - lo) / 15).to(torch.float16)
        z = torch.clamp(torch.round(-lo / s.float()), 0, 15).long()  # [groups, out]
        q = torch.clamp(torch.round(g / s.float()[:, None]) + z[:, None], 0, 15).long().reshape(cols, rows)
        tensors[f"{name}.qweight"] = _t(pack_fields(q.numpy(), 4, AWQ_INTERLEAVE))
        tensors[f"{name}.qzeros"] = _t(pack_fields(z.numpy(), 4, AWQ_INTERLEAVE))
        tensors[f"{name}.scales"] = s
        zi = z.repeat_interleave(GROUP, 0)
        deq[name] = ((q - zi).to(torch.float16) * s.repeat_interleave(GROUP, 0)).t().float()
    qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False, "format": "gemm",
          "checkpoint_format": "gemm", "pack_dtype": "int32", "lm_head": False}
    return _save(out, reference, tensors, qc), deq, None


# --------------------------------------------------------------------------------------- GGUF (gguf package)
def _to_gguf_rows(w: torch.Tensor, heads: int) -> np.ndarray:
    """llama.cpp's converter order of q / k rows: the two RoPE halves of every head interleaved."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(rows, -1).numpy()


def _from_gguf_rows(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def build_gguf(reference: Path, out: Path, kind: str, arch: str = "llama"):
    """A GGUF file written with the gguf package: every block Linear quantized to `kind` (gguf.quants), norms and
    token embedding F32, no output tensor (tied); dequantized back with gguf.quants for the truth."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    out.mkdir(parents=True, exist_ok=True)
    file = out / f"tiny.{kind}.gguf"
    writer = gguf.GGUFWriter(str(file), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type({"Q8_0": 7, "Q4_0": 2, "Q4_1": 3}[kind])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reference)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tok.convert_ids_to_tokens(list(range(len(tok)))))
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    plain = _plain_tensors(reference)
    writer.add_tensor("token_embd.weight", plain["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", plain["model.norm.weight"].numpy())
    deq = {}
    for name, w in _linear_weights(reference).items():
        layer, module = name.split(".")[2], name.split(".", 3)[3]
        heads = HEADS if module.endswith("q_proj") else KV_HEADS if module.endswith("k_proj") else 0
        rows = _to_gguf_rows(w, heads) if heads else w.numpy()
        packed = gguf.quants.quantize(np.ascontiguousarray(rows, dtype=np.float32), qtype)
        back = gguf.quants.dequantize(packed, qtype).reshape(rows.shape)
        deq[name] = torch.from_numpy(np.ascontiguousarray(_from_gguf_rows(back, heads) if heads else back))
        writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.weight", packed, raw_dtype=qtype)
    for n in range(LAYERS):
        writer.add_tensor(f"blk.{n}.attn_norm.weight", plain[f"model.layers.{n}.input_layernorm.weight"].numpy())
        writer.add_tensor(f"blk.{n}.ffn_norm.weight",
                          plain[f"model.layers.{n}.post_attention_layernorm.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file, deq, None


# --------------------------------------------------------------------------------------- the truth
def _fake_quant(kind: str):
    """Per-token symmetric activation quantize-dequantize as compressed-tensors' runtime does it: s = absmax over the
    hidden dimension / (int8: 255 / 2, fp8 e4m3: 448); int codes rounded half to even and clamped to [-128, 127],
    fp8 codes cast to e4m3."""
    def hook(_module, args):
        x = args[0]
        if kind == "int8":
            s = x.abs().amax(-1, keepdim=True) / 127.5
            return (torch.clamp(torch.round(x / s), -128, 127) * s,)
        s = x.abs().amax(-1, keepdim=True) / 448.0
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,)
    return hook


def independent_model(reference: Path, deq: dict, act: str | None, plain: dict | None = None):
    """The reference with the independently dequantized Linear weights (and the checkpoint's own float tensors)."""
    model = _ref_model(reference)
    sd = model.state_dict()
    with torch.no_grad():
        for name, w in deq.items():
            sd[f"{name}.weight"].copy_(w)
        for name, v in (plain or {}).items():
            if name in sd:
                sd[name].copy_(v.float())
    if act:
        for name, m in model.named_modules():
            if name.endswith(LINEARS):
                m.register_forward_pre_hook(_fake_quant(act))
    return model


def _engine(ckpt: Path):
    from quantlab.engines.torch_engine import load_exported
    from quantlab.env import resolve_device

    model, plan = load_exported(ckpt, resolve_device("cpu"), torch.float32)
    return model.eval(), plan


IDS = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))

BUILDERS = {
    "ct-fp8-dynamic": (lambda r, o: build_ct_fp8(r, o), "compressed-tensors", {"CT_FP8": 14}),
    "ct-w8a8-int8": (lambda r, o: build_ct_w8a8(r, o), "compressed-tensors", {"CT_INT8": 14}),
    "ct-w4a16-sym": (lambda r, o: build_ct_w4a16(r, o, True), "compressed-tensors", {"CT_PACKED_INT4": 14}),
    "ct-w4a16-asym": (lambda r, o: build_ct_w4a16(r, o, False), "compressed-tensors", {"CT_PACKED_INT4": 14}),
    "gptq-v1-actorder": (lambda r, o: build_gptq(r, o, True), "gptq", {"GPTQ_INT4": 14}),
    "gptq-v1": (lambda r, o: build_gptq(r, o, False), "gptq", {"GPTQ_INT4": 14}),
    "gptq-v2-asym-actorder": (lambda r, o: build_gptq(r, o, True, v2=True), "gptq", {"GPTQ_INT4": 14}),
    "awq-gemm": (lambda r, o: build_awq(r, o), "gptq", {"AWQ_GEMM_INT4": 14}),
    "gguf-q8_0": (lambda r, o: build_gguf(r, o, "Q8_0"), "gguf", {"GGUF_Q8_0": 14}),
    "gguf-q4_0": (lambda r, o: build_gguf(r, o, "Q4_0"), "gguf", {"GGUF_Q4_0": 14}),
    "gguf-q4_1": (lambda r, o: build_gguf(r, o, "Q4_1"), "gguf", {"GGUF_Q4_1": 14}),
}


@pytest.fixture(scope="module")
def built(reference, tmp_path_factory):
    """name -> (checkpoint path, independently dequantized weights, activation kind), built once."""
    root = tmp_path_factory.mktemp("ckpts")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = BUILDERS[name][0](reference, root / name)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(BUILDERS))
def test_engine_logits_equal_the_independent_dequantization(name, built, reference):
    """Detection picks the format; every Linear is read by the format's layer class; the engine's logits equal the
    reference model's carrying the independently dequantized weights (plus the format's activation quantization)
    within float tolerance."""
    from quantlab.formats import detect

    ckpt, deq, act = built(name)
    _, fmt, formats = BUILDERS[name]
    assert detect(ckpt).name == fmt
    engine, plan = _engine(ckpt)
    assert plan["formats"] == formats and plan["format"] == fmt
    plain = None
    if fmt == "gptq":  # its own embedding and norms (stored bf16) are what a loader must use
        from safetensors.torch import load_file

        plain = {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if v.is_floating_point()
                 and v.dtype == torch.bfloat16}
    truth = independent_model(reference, deq, act, plain)
    with torch.no_grad():
        a, b = engine(IDS).logits.float(), truth(IDS).logits.float()
        ref = _ref_model(reference)(IDS).logits.float()
    spread = float(b.std())
    err = float((a - b).abs().max())
    # weight-only formats: fp32 rounding of the same products; per-token activation quantization: a rounding
    # boundary may flip for a value or two between two fp32 GEMM orders, so a looser (still tight) bound
    assert err <= (2e-4 if act is None else 3e-3) * spread, (name, err, spread)
    assert float((a - ref).abs().max()) > 10 * err  # the comparison can tell quantized from unquantized


def test_gguf_engine_matches_its_dequantized_rows_bit_for_bit(built):
    """quantlab's ggml block dequantizer (and q / k un-permutation) reproduces gguf.quants.dequantize exactly."""
    for name in ("gguf-q8_0", "gguf-q4_0", "gguf-q4_1"):
        ckpt, deq, _ = built(name)
        engine, _ = _engine(ckpt)
        modules = dict(engine.named_modules())
        for module, w in deq.items():
            assert torch.equal(modules[module].dequantized_weight(), w.float()), (name, module)


def test_packer_round_trip_and_quantlab_unpack_agree():
    """The test's packer against its own reader, and quantlab's unpack against the test's packer (plain and AWQ
    interleaved orders, both dimensions)."""
    from quantlab.formats.packing import AWQ_ORDER, unpack

    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, size=(16, 32))
    for order in (None, AWQ_INTERLEAVE):
        words = pack_fields(codes, 4, order)
        assert (unpack_fields(words, 4, order) == codes).all()
        assert (unpack(_t(words), 4, 1, AWQ_ORDER if order else None).numpy() == codes).all()
    words = pack_fields(codes.T, 4).T  # along the rows
    assert (unpack(_t(np.ascontiguousarray(words)), 4, 0).numpy() == codes).all()


# --------------------------------------------------------------------------------------- the audit
@pytest.mark.parametrize("name", ["ct-w4a16-asym", "gptq-v1-actorder", "gptq-v2-asym-actorder", "awq-gemm", "gguf-q4_0",
                                  "ct-fp8-dynamic"])
def test_healthy_checkpoints_pass_the_audit(name, built, reference):
    from quantlab.audit.checks import audit

    ckpt, _, _ = built(name)
    report = audit(ckpt, reference, canary=False, device="cpu")
    assert not report.errors, [f.message for f in report.errors]


def _damaged_copy(built, name: str, tmp_path: Path, damage) -> Path:
    from safetensors.torch import load_file, save_file

    ckpt, _, _ = built(name)
    out = tmp_path / f"{name}-damaged"
    shutil.copytree(ckpt, out)
    tensors = load_file(str(out / "model.safetensors"))
    damage(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _zero_scale(key):
    def damage(t):
        t[key] = torch.zeros_like(t[key])
    return damage


def _swap_zero_points(key):
    def damage(t):
        t[key] = t[key].flip(0).contiguous()
    return damage


def _plain_order(prefix):
    """AWQ words rewritten as if packed in plain order (the interleave forgotten)."""
    def damage(t):
        for suffix in ("qweight", "qzeros"):
            codes = unpack_fields(t[f"{prefix}.{suffix}"].numpy(), 4, AWQ_INTERLEAVE)
            t[f"{prefix}.{suffix}"] = _t(pack_fields(codes, 4))
    return damage


DAMAGE = {
    "zero scales (compressed-tensors)": ("ct-w4a16-asym", _zero_scale("model.layers.0.self_attn.q_proj.weight_scale")),
    "zero scales (GPTQ)": ("gptq-v1", _zero_scale("model.layers.1.mlp.up_proj.scales")),
    "swapped zero points (compressed-tensors)": ("ct-w4a16-asym",
                                                 _swap_zero_points("model.layers.0.mlp.down_proj.weight_zero_point")),
    "swapped zero points (GPTQ v2)": ("gptq-v2-asym-actorder",
                                      _swap_zero_points("model.layers.0.mlp.gate_proj.qzeros")),
    "swapped zero points (AWQ)": ("awq-gemm", _swap_zero_points("model.layers.0.mlp.gate_proj.qzeros")),
    "wrong packing order (AWQ)": ("awq-gemm", _plain_order("model.layers.1.self_attn.o_proj")),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_damaged_checkpoints_fail_the_audit(what, built, reference, tmp_path):
    from quantlab.audit.checks import audit

    name, damage = DAMAGE[what]
    ckpt = _damaged_copy(built, name, tmp_path, damage)
    report = audit(ckpt, reference, canary=False, device="cpu")  # a finding, not a refusal to audit
    assert report.errors, what


# --------------------------------------------------------------------------------------- unsupported layouts
def _edit_config(built, name: str, tmp_path: Path, edit) -> Path:
    ckpt, _, _ = built(name)
    out = tmp_path / f"{name}-edited"
    shutil.copytree(ckpt, out)
    config = json.loads((out / "config.json").read_text())
    edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def _set(path: list[str], value):
    def edit(qc):
        node = qc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


UNSUPPORTED = {
    "ct actorder group": ("ct-w4a16-sym", _set(["config_groups", "group_0", "weights", "actorder"], "group"),
                          "actorder"),
    "ct sparsity": ("ct-w4a16-sym", _set(["sparsity_config"], {"format": "sparse-24-bitmask"}), "sparsity_config"),
    "gptq marlin": ("gptq-v1", _set(["checkpoint_format"], "marlin"), "marlin"),
    "gptq 3 bit": ("gptq-v1", _set(["bits"], 3), "3-bit"),
    "unknown quant_method": ("gptq-v1", _set(["quant_method"], "hqq"), "hqq"),
}


@pytest.mark.parametrize("what", list(UNSUPPORTED))
def test_unsupported_layouts_exit_2_naming_what_was_found(what, built, tmp_path):
    from quantlab.errors import QuantlabError
    from quantlab.formats import open_checkpoint

    name, edit, named = UNSUPPORTED[what]
    ckpt = _edit_config(built, name, tmp_path, edit)
    with pytest.raises(QuantlabError) as exc:
        open_checkpoint(ckpt)
    assert exc.value.exit_code == 2
    assert named in str(exc.value), str(exc.value)


def test_unsupported_gguf_architecture_and_garbage_exit_2(reference, tmp_path):
    from quantlab.errors import QuantlabError
    from quantlab.formats import open_checkpoint

    file, _, _ = build_gguf(reference, tmp_path / "gpt2", "Q8_0", arch="gpt2")
    with pytest.raises(QuantlabError, match="general.architecture='gpt2'") as exc:
        open_checkpoint(file)
    assert exc.value.exit_code == 2
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16)
    with pytest.raises(QuantlabError, match="not a readable GGUF file") as exc:
        open_checkpoint(garbage)
    assert exc.value.exit_code == 2


def test_truncated_packed_tensor_is_refused_at_load(built, tmp_path):
    """A pack-quantized weight whose words do not cover its input width: exit 2 naming the tensor."""
    from quantlab.errors import QuantlabError

    def damage(t):
        key = "model.layers.0.mlp.up_proj.weight_packed"
        t[key] = t[key][:, :-1].contiguous()

    ckpt = _damaged_copy(built, "ct-w4a16-sym", tmp_path, damage)
    with pytest.raises(QuantlabError, match="up_proj.weight_packed") as exc:
        _engine(ckpt)
    assert exc.value.exit_code == 2


def test_audit_cli_exits_2_on_an_unquantized_model_and_0_on_a_healthy_export(built, reference, capsys):
    """`python -m quantlab.audit DIR`: a plain model directory is no format quantlab reads (exit 2 naming what was
    found); a healthy GPTQ export passes (exit 0)."""
    from quantlab.audit.__main__ import main

    assert main([str(reference), "--no-canary"]) == 2
    assert "declares no quantization_config" in capsys.readouterr().err
    ckpt, _, _ = built("gptq-v1-actorder")
    assert main([str(ckpt), "--reference", str(reference), "--no-canary", "--device", "cpu"]) == 0


def test_engine_checkpoint_of_another_tool_implies_precision_external(built):
    """engine.checkpoint=DIR without a precision: a foreign format selects precision=external (nothing calibrated)."""
    from quantlab.compose import implied

    ckpt, _, _ = built("ct-fp8-dynamic")
    assert "precision=external" in implied([f"engine.checkpoint={ckpt}"])


# the f16 fields (d, m / dmin) of each block type, by byte offset: set to small finite values in random blocks
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82], "Q3_K": [108],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


@pytest.mark.parametrize("kind", list(F16_FIELDS))
def test_every_ggml_block_type_dequantizes_as_the_gguf_package_does(kind):
    """Random blocks of every type quantlab reads (K-quants included, which the gguf package cannot write):
    quantlab's dequantizer equals gguf.quants.dequantize bit for bit."""
    import gguf

    from quantlab.formats import ggml

    values, size = ggml.BLOCKS[kind]
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(3, 2 * size), dtype=np.uint8)
    for block in range(2):
        for at in F16_FIELDS[kind]:
            d = np.array(rng.uniform(-0.02, 0.02, size=3), dtype=np.float16).view(np.uint8).reshape(3, 2)
            raw[:, block * size + at:block * size + at + 2] = d
    theirs = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(3, 2 * values)
    ours = ggml.dequantize(torch.from_numpy(raw), kind).numpy()
    assert np.array_equal(ours, theirs)


def test_gptq_made_compressed_tensors_layers_are_audited_with_gptq_bounds(built, tmp_path):
    """llm-compressor's recipe.yaml naming GPTQModifier: the layers are CT_PACKED_INT4_GPTQ (the same numerics), whose
    audit bounds allow GPTQ's error compensation; without it, CT_PACKED_INT4 with the int4 bounds."""
    from quantlab.audit.bounds import weight_bounds
    from quantlab.formats import open_checkpoint

    ckpt, _, _ = built("ct-w4a16-sym")
    out = tmp_path / "gptq-made"
    shutil.copytree(ckpt, out)
    (out / "recipe.yaml").write_text("default_stage:\n  default_modifiers:\n    GPTQModifier:\n      targets: Linear\n")
    plain, gptq = open_checkpoint(ckpt), open_checkpoint(out)
    module = "model.layers.0.mlp.down_proj"
    assert plain.quant.format_of(module).quant_algo == "CT_PACKED_INT4"
    assert gptq.quant.format_of(module).quant_algo == "CT_PACKED_INT4_GPTQ"
    assert weight_bounds("CT_PACKED_INT4_GPTQ").cosine_error < weight_bounds("CT_PACKED_INT4").cosine_error
    engine, plan = _engine(out)
    assert plan["formats"] == {"CT_PACKED_INT4_GPTQ": 14}


def test_gguf_with_zeroed_block_scales_fails_the_audit(built, reference, tmp_path):
    """A Q4_0 tensor whose blocks' f16 scales were zeroed (offsets found with the gguf package's reader): an error."""
    import gguf

    from quantlab.audit.checks import audit

    ckpt, _, _ = built("gguf-q4_0")
    out = tmp_path / "damaged.Q4_0.gguf"
    shutil.copy(ckpt, out)
    target = next(t for t in gguf.GGUFReader(str(out)).tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(out.read_bytes())
    for block in range(target.n_bytes // 18):  # Q4_0: f16 d, then 16 bytes of nibbles
        at = target.data_offset + block * 18
        data[at:at + 2] = b"\x00\x00"
    out.write_bytes(bytes(data))
    report = audit(out, reference, canary=False, device="cpu")
    assert any("scale 0" in f.message for f in report.errors), [f.message for f in report.findings]


def test_precision_external_without_a_checkpoint_is_refused():
    from conftest import compose

    from quantlab.errors import QuantlabError
    from quantlab.preflight import check_config

    cfg, _ = compose(["precision=external"])
    with pytest.raises(QuantlabError, match="evaluates a checkpoint made elsewhere"):
        check_config(cfg)


def test_compressed_tensors_fp8_kv_cache_scheme_is_applied(built, tmp_path):
    """kv_cache_scheme {float, 8 bit, tensor, static} with <attention>.k_scale / v_scale [1]: the engine quantizes K
    and V on every attention module (logits move, a little); a missing v_scale is exit 2 naming it."""
    from safetensors.torch import load_file, save_file

    from quantlab.errors import QuantlabError

    def with_kv(drop: str | None) -> Path:
        out = _edit_config(built, "ct-fp8-dynamic", tmp_path / (drop or "kv"), _set(
            ["kv_cache_scheme"], {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                  "symmetric": True}))
        tensors = load_file(str(out / "model.safetensors"))
        for n in range(LAYERS):
            for kind in ("k_scale", "v_scale"):
                name = f"model.layers.{n}.self_attn.{kind}"
                if name != drop:
                    tensors[name] = torch.tensor([0.02])  # e4m3 range +-9: above this model's K and V
        save_file(tensors, str(out / "model.safetensors"))
        return out

    plain, _ = _engine(built("ct-fp8-dynamic")[0])
    kv, plan = _engine(with_kv(None))
    assert plan["kv_cache"].startswith("fp8 (k_scale / v_scale on 2 attention modules")
    with torch.no_grad():
        a, b = plain(IDS).logits, kv(IDS).logits
    assert float((a - b).abs().max()) > 0 and float((a - b).abs().mean()) < 0.15 * float(a.std())
    with pytest.raises(QuantlabError, match="v_scale") as exc:
        _engine(with_kv("model.layers.1.self_attn.v_scale"))
    assert exc.value.exit_code == 2
