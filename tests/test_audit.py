"""quantlab.audit on real ModelOpt exports of the tiny Llama: healthy exports of every precision, with and without
FP8 KV, give no error finding; every fault class of FAULTS, made by damaging a copy of a healthy export the way the
real bug did, is found by the right check, naming the module it damaged; the CLI's exit codes; the audit step.

FAULTS is also what bench/audit_bench.py runs on the default model (its detection table).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from conftest import FAST, REPO, cli_env, run_api, run_module

HEALTHY = [(p, kv) for p in ("fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4") for kv in ("none", "fp8")]
# the smallest calibration issue 25 calls healthy (8 x 256 tokens); FAST's 4 x 64 leaves INT8 activation scales
# clipping the held-out text's outliers by 10 dB: an export nobody should ship
CALIB = ["calib.num_samples=8", "calib.seq_len=256", "calib.batch_size=4"]
EXPORT_FAST = [o for o in FAST if not o.startswith("calib.")] + CALIB
SCALE_NAMES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")


# ------------------------------------------------------------------------------------------ damaging exports
class Export:
    """A copy of an exported checkpoint opened for damage: its tensors (all shards in one dict), its JSON files,
    and the reference's tensors to damage it with. save() writes one model.safetensors in place of the shards."""

    def __init__(self, path: Path, reference: Path):
        from safetensors.torch import load_file

        self.path, self.reference = path, reference
        self.tensors: dict = {}
        for f in sorted(path.glob("*.safetensors")):
            self.tensors.update(load_file(str(f)))

    def ref(self, name: str):
        from safetensors import safe_open

        for f in sorted(self.reference.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                if name in h.keys():
                    return h.get_tensor(name)
        raise KeyError(name)

    def ref_names(self) -> set[str]:
        from safetensors import safe_open

        names = set()
        for f in sorted(self.reference.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                names.update(h.keys())
        return names

    def modules(self) -> list[str]:
        """The quantized modules (those with a weight_scale), in layer order."""
        from quantlab.audit.report import _natural

        return sorted((n[: -len(".weight_scale")] for n in self.tensors if n.endswith(".weight_scale")), key=_natural)

    def pick(self, what: str) -> str:
        """The last layer's module whose name ends with `what` (mlp.down_proj, self_attn.o_proj, ...)."""
        return [m for m in self.modules() if m.endswith(what)][-1]

    def json(self, name: str) -> dict:
        return json.loads((self.path / name).read_text())

    def put_json(self, name: str, doc: dict) -> None:
        (self.path / name).write_text(json.dumps(doc, indent=2))

    def save(self) -> None:
        """Write the tensors back: one model.safetensors, or the shards and index a damage set up (self.shards)."""
        from safetensors.torch import save_file

        if getattr(self, "written", False):
            return  # the damage wrote the files itself
        for f in self.path.glob("*.safetensors"):
            f.unlink()
        (self.path / "model.safetensors.index.json").unlink(missing_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(self.path / "model.safetensors"),
                  metadata={"format": "pt"})

    def save_sharded(self, shards: int, order=None) -> dict[str, str]:
        """Write the tensors as `shards` files with a correct model.safetensors.index.json (as save_pretrained
        shards); returns the weight map. The damage that calls it writes no single file."""
        from safetensors.torch import save_file

        for f in self.path.glob("*.safetensors"):
            f.unlink()
        names = list(order or self.tensors)
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({k: self.tensors[k].contiguous() for k in part}, str(self.path / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in part})
        self.put_json("model.safetensors.index.json", {"metadata": {"total_size": 0}, "weight_map": weight_map})
        self.written = True
        return weight_map


def _fp8(x):
    import torch

    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn)


def unquantized_layer(e: Export) -> list[str]:
    m = e.pick("mlp.down_proj")
    e.tensors[f"{m}.weight"] = e.ref(f"{m}.weight")
    for s in SCALE_NAMES:
        e.tensors.pop(f"{m}.{s}", None)
    return [m]


def unquantized_copy(e: Export) -> list[str]:
    import torch

    modules = e.modules()
    for m in modules:
        e.tensors[f"{m}.weight"] = e.ref(f"{m}.weight")
        for s in SCALE_NAMES:
            e.tensors.pop(f"{m}.{s}", None)
        e.tensors[f"{m}.weight_scale"] = torch.tensor(1.0)
        e.tensors[f"{m}.input_scale"] = torch.tensor(1.0)
    return modules


def excluded_but_quantized(e: Export) -> list[str]:
    """The output head (or, in a tied model, a layer exclude_modules lists) quantized though excluded."""
    if "lm_head.weight" in e.tensors:
        source = e.modules()[0]
        w = e.tensors["lm_head.weight"].float()
        scale = w.abs().max() / 448
        e.tensors["lm_head.weight"] = _fp8(w / scale)
        e.tensors["lm_head.weight_scale"] = scale.reshape(())
        e.tensors["lm_head.input_scale"] = e.tensors[f"{source}.input_scale"].clone()
        return ["lm_head"]
    m = e.pick("mlp.down_proj")
    hf = e.json("hf_quant_config.json")
    hf["quantization"]["exclude_modules"].append(m)
    cfg = e.json("config.json")
    cfg["quantization_config"]["ignore"].append(m)
    e.put_json("hf_quant_config.json", hf)
    e.put_json("config.json", cfg)
    return [m]


def scale_zero(e: Export) -> list[str]:
    m = e.pick("self_attn.o_proj")
    e.tensors[f"{m}.weight_scale"] = e.tensors[f"{m}.weight_scale"] * 0
    return [m]


def scale_negative(e: Export) -> list[str]:
    m = e.pick("self_attn.q_proj")
    e.tensors[f"{m}.weight_scale"] = -e.tensors[f"{m}.weight_scale"]
    return [m]


def scale_nan(e: Export) -> list[str]:
    m = e.pick("mlp.up_proj")
    e.tensors[f"{m}.input_scale"] = e.tensors[f"{m}.input_scale"] * float("nan")
    return [m]


def fp8_block_scale_underflow(e: Export) -> list[str]:
    """NVFP4 per-block FP8 scales of the smallest quarter of the blocks rounded to 0 (no clamp before the cast)."""
    import torch

    m = e.pick("mlp.down_proj")
    s = e.tensors[f"{m}.weight_scale"].float()
    s[s <= torch.quantile(s, 0.25)] = 0
    e.tensors[f"{m}.weight_scale"] = s.to(torch.float8_e4m3fn)
    return [m]


def scale_subnormal(e: Export) -> list[str]:
    """A per-tensor scale that underflowed to a float32 denormal (amax divided twice)."""
    import torch

    m = e.pick("self_attn.k_proj")
    e.tensors[f"{m}.weight_scale"] = torch.tensor(1e-40, dtype=torch.float32)
    return [m]


def group_size_mismatch(e: Export) -> list[str]:
    hf = e.json("hf_quant_config.json")
    hf["quantization"]["group_size"] //= 2
    e.put_json("hf_quant_config.json", hf)
    return e.modules()


def kv_scales_one(e: Export) -> list[str]:
    import torch

    names = [n for n in e.tensors if n.endswith((".k_scale", ".v_scale"))]
    for n in names:
        e.tensors[n] = torch.tensor(1.0)
    return [n.rpartition(".")[0] for n in names]


def halved_scales(e: Export) -> list[str]:
    """Every NVFP4 block scale halved, codes unchanged (the low-memory export with half-sized weight scales)."""
    import torch

    for m in e.modules():
        e.tensors[f"{m}.weight_scale"] = (e.tensors[f"{m}.weight_scale"].float() / 2).to(torch.float8_e4m3fn)
    return e.modules()


def scrambled_block_scales(e: Export) -> list[str]:
    """NVFP4 block scales written in another block order than their codes (a strided copy gone wrong)."""
    import torch

    m = e.pick("mlp.gate_proj")
    s = e.tensors[f"{m}.weight_scale"]
    perm = torch.randperm(s.shape[1], generator=torch.Generator().manual_seed(0))
    e.tensors[f"{m}.weight_scale"] = s.view(torch.uint8)[:, perm].contiguous().view(torch.float8_e4m3fn)
    return [m]


def dedupe_dropped(e: Export) -> list[str]:
    """A tied-weight dedupe drops a weight it took for a copy: the untied output head (or, in a tied model, a norm
    equal in value to another)."""
    if "lm_head.weight" in e.ref_names():
        del e.tensors["lm_head.weight"]
        return ["lm_head"]
    norm = sorted(n for n in e.tensors if n.endswith("post_attention_layernorm.weight"))[-1]
    del e.tensors[norm]
    return [norm.rpartition(".")[0]]


def config_changed(e: Export) -> list[str]:
    cfg = e.json("config.json")
    cfg["max_position_embeddings"] *= 8
    e.put_json("config.json", cfg)
    return []


def tokenizer_changed(e: Export) -> list[str]:
    tok = e.json("tokenizer.json")
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    e.put_json("tokenizer.json", tok)
    return []


def chat_template_changed(e: Export) -> list[str]:
    cfg = e.json("tokenizer_config.json")
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    e.put_json("tokenizer_config.json", cfg)
    (e.path / "chat_template.jinja").unlink(missing_ok=True)
    return []


def generation_config_changed(e: Export) -> list[str]:
    gen = e.json("generation_config.json")
    gen["eos_token_id"] = 3 if gen.get("eos_token_id") != 3 else 4
    e.put_json("generation_config.json", gen)
    return []


def algo_mismatch(e: Export) -> list[str]:
    """hf_quant_config.json (and config.json) say FP8; the tensors are INT8 SmoothQuant."""
    for name in ("hf_quant_config.json", "config.json"):
        doc = e.json(name)
        (doc["quantization"] if name == "hf_quant_config.json" else doc["quantization_config"])["quant_algo"] = "FP8"
        e.put_json(name, doc)
    return e.modules()


def input_scale_missing(e: Export) -> list[str]:
    """The last MLP's input quantizers were never calibrated (the MoE expert that got no tokens): no input_scale."""
    mods = [e.pick(p) for p in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    for m in mods:
        del e.tensors[f"{m}.input_scale"]
    return mods


def activation_saturation(e: Export) -> list[str]:
    """Every activation scale 1/64 of its calibrated value (input quantizers calibrated on a handful of tokens):
    every tensor is positive and finite, the activations saturate."""
    for m in e.modules():
        e.tensors[f"{m}.input_scale"] = e.tensors[f"{m}.input_scale"] / 64
    return []


def swapped_layers(e: Export) -> list[str]:
    """Decoder layers 0 and 1 written under each other's names (an index mix-up in a sharded writer)."""
    a, b = "model.layers.0.", "model.layers.1."
    renamed = {}
    for name, t in e.tensors.items():
        renamed[b + name[len(a):] if name.startswith(a) else a + name[len(b):] if name.startswith(b) else name] = t
    e.tensors = renamed
    return [m for m in e.modules() if m.startswith((a, b))]


def _int4_rtn(w, group: int):
    """Round-to-nearest int4 of a [out, in] weight in groups of `group` inputs, packed as ModelOpt packs W4A16_AWQ:
    two codes per byte along the output dimension (row 2j low nibble). -> (packed uint8 [out/2, in], scales)."""
    import torch

    w = w.float()
    scale = w.reshape(w.shape[0], -1, group).abs().amax(-1).clamp_min(1e-8) / 7
    q = (w / scale.repeat_interleave(group, dim=1)).round().clamp(-8, 7).to(torch.int16)
    return ((q[0::2] & 0xF) | ((q[1::2] & 0xF) << 4)).to(torch.uint8), scale


def fused_group_mixed_formats(e: Export) -> list[str]:
    """A mixed-precision export whose last q/k/v group is split: q_proj FP8, k_proj and v_proj W4A16_AWQ (export
    checks equal formats only when the group's first member is not FP8, so it wrote this without a word)."""
    q = e.pick("self_attn.q_proj")
    parent = q.rpartition(".")[0]
    layers = {m: {"quant_algo": "FP8"} for m in e.modules()}
    for m in (f"{parent}.k_proj", f"{parent}.v_proj"):
        e.tensors[f"{m}.weight"], e.tensors[f"{m}.weight_scale"] = _int4_rtn(e.ref(f"{m}.weight"), 32)
        del e.tensors[f"{m}.input_scale"]
        layers[m] = {"quant_algo": "W4A16_AWQ", "group_size": 32, "has_zero_point": False, "pre_quant_scale": True}
    hf = e.json("hf_quant_config.json")
    hf["quantization"] = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers}
    cfg = e.json("config.json")
    cfg["quantization_config"].update(quant_algo="MIXED_PRECISION", quantized_layers=layers, ignore=[])
    e.put_json("hf_quant_config.json", hf)
    e.put_json("config.json", cfg)
    return [q, f"{parent}.k_proj", f"{parent}.v_proj"]


# ----------------------------------------------- activation scales against the activations they quantize
def int8_input_scale_in_fp8_units(e: Export) -> list[str]:
    """NVIDIA/Model-Optimizer#215 (INT8 <-> FP8 scale conversion by 448/127 the wrong way round): every INT8
    SmoothQuant input_scale written as amax / 448, FP8's unit, instead of amax / 127: 3.5x too small, the
    activations clip at a quarter of their range. Finite, positive, the right dtype and shape."""
    for m in e.modules():
        e.tensors[f"{m}.input_scale"] = e.tensors[f"{m}.input_scale"] * (127 / 448)
    return e.modules()


def fp8_input_scale_without_qmax(e: Export) -> list[str]:
    """huggingface/transformers#42744 (an FP8 checkpoint whose activation scales are off by orders of magnitude):
    every input_scale written as amax, not amax / 448: every activation lands in E4M3's subnormals."""
    for m in e.modules():
        e.tensors[f"{m}.input_scale"] = e.tensors[f"{m}.input_scale"] * 448
    return e.modules()


def one_layer_input_scale_too_small(e: Export) -> list[str]:
    """NVIDIA/Model-Optimizer#1354 and vllm-project/llm-compressor#916 (layers calibrated on too few tokens): one
    down_proj's input_scale 10x too small, its outliers clip; the other 13 layers are healthy."""
    m = e.pick("mlp.down_proj")
    e.tensors[f"{m}.input_scale"] = e.tensors[f"{m}.input_scale"] / 10
    return [m]


def kv_scales_too_small(e: Export) -> list[str]:
    """vllm-project/vllm#54705 (V outliers clip in an FP8 cache whose scales do not cover them): the last layer's
    k_scale and v_scale 10x too small."""
    names = sorted(n for n in e.tensors if n.endswith((".k_scale", ".v_scale")))[-2:]
    for n in names:
        e.tensors[n] = e.tensors[n] / 10
    return [n.rpartition(".")[0] for n in names]


# ---------------------------------------------------------- what serving engines load vs what is on disk
def stale_single_file_beside_shards(e: Export) -> list[str]:
    """Blaizzy/mlx-vlm#1464 (a stray model.safetensors shipped next to the shards of another export): the export
    re-sharded with its index, and an older single file left beside it whose down_proj scales differ.
    transformers loads model.safetensors, vLLM the shards."""
    from safetensors.torch import save_file

    m = e.pick("mlp.down_proj")
    e.save_sharded(2)
    old = dict(e.tensors)
    old[f"{m}.weight_scale"] = old[f"{m}.weight_scale"] * 2
    save_file({k: v.contiguous() for k, v in old.items()}, str(e.path / "model.safetensors"))
    return [m]


def index_names_missing_shard(e: Export) -> list[str]:
    """Neph0s/CoSER#3 (the index expects 30 shards, 15 were provided): three shards, the second not copied."""
    weight_map = e.save_sharded(3)
    lost = sorted(set(weight_map.values()))[1]
    (e.path / lost).unlink()
    return sorted({t.rpartition(".")[0] for t, f in weight_map.items() if f == lost})


def stale_index_after_resharding(e: Export) -> list[str]:
    """Blaizzy/mlx-vlm#1827 and ddalcu/mlx-serve#465 (shards re-cut without regenerating the index): the index of
    a 2-shard layout over a 3-shard directory: tensors listed in the wrong shard."""
    old_map = e.save_sharded(2)
    for f in e.path.glob("model-*.safetensors"):
        f.unlink()
    new_map = e.save_sharded(3)
    stale = {k: v.replace("-of-00002", "-of-00003") for k, v in old_map.items()}
    e.put_json("model.safetensors.index.json", {"metadata": {}, "weight_map": stale})
    return sorted({t.rpartition(".")[0] for t in new_map if new_map[t] != stale[t]})


def consolidated_copy_without_index(e: Export) -> list[str]:
    """vllm-project/vllm#40765 (a consolidated checkpoint loaded together with the HF files): model.safetensors and
    a consolidated.safetensors of the unquantized reference's MLP weights, no index; vLLM loads both files."""
    from safetensors.torch import save_file

    mods = [m for m in e.modules() if ".mlp." in m]
    save_file({f"{m}.weight": e.ref(f"{m}.weight").contiguous() for m in mods},
              str(e.path / "consolidated.safetensors"))
    e.written = True  # model.safetensors stays as copied
    return mods


# -------------------------------------------------------------------------- tokenizer behaviour
def tokenizer_merge_dropped(e: Export) -> list[str]:
    """huggingface/transformers#34744 (tokenizer.json's merges rewritten by save_pretrained): the highest-priority
    merge dropped; vocabulary, special tokens and every other section unchanged."""
    tok = e.json("tokenizer.json")
    tok["model"]["merges"] = tok["model"]["merges"][1:]
    e.put_json("tokenizer.json", tok)
    return []


def tokenizer_decoder_dropped(e: Export) -> list[str]:
    """huggingface/tokenizers#1340 (an exported tokenizer whose decode keeps the byte-level 'G' characters): the
    ByteLevel decoder removed; encoding is unchanged, decoding is not."""
    tok = e.json("tokenizer.json")
    tok["decoder"] = None
    e.put_json("tokenizer.json", tok)
    return []


# ------------------------------------------------------------------------- declarations that disagree
def kv_cache_scheme_disagrees(e: Export) -> list[str]:
    """sgl-project/sglang#10132 and NVIDIA/TensorRT-LLM#14088 (engines reading kv_cache_scheme each their own way):
    config.json's kv_cache_scheme says 8-bit int where hf_quant_config.json says FP8."""
    cfg = e.json("config.json")
    cfg["quantization_config"]["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "int"}
    e.put_json("config.json", cfg)
    return []


def config_groups_disagree(e: Export) -> list[str]:
    """NVIDIA/TensorRT-LLM#3167 (review: nothing checks hf_quant_config.json against config.json when both exist
    and conflict): config.json's config_groups copied from an NVFP4 export, quant_algo still FP8."""
    cfg = e.json("config.json")
    cfg["quantization_config"]["config_groups"] = {"group_0": {
        "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}, "targets": ["Linear"]}}
    e.put_json("config.json", cfg)
    return []


def kv_declared_in_one_file(e: Export) -> list[str]:
    """ai-dynamo/aiconfigurator#1513 (kv_cache_quant_algo FP8 in hf_quant_config.json, no kv_cache_scheme in the
    paired config.json): config.json loses its kv_cache_scheme."""
    cfg = e.json("config.json")
    del cfg["quantization_config"]["kv_cache_scheme"]
    e.put_json("config.json", cfg)
    return []


# --------------------------------------------------------------------- explanations that must be right
def awq_pre_quant_scale_dropped(e: Export) -> list[str]:
    """NVIDIA/Model-Optimizer#1520 (o_proj's pre_quant_scale left unfused for grouped-query attention, and a loader
    that does not consume it): the last o_proj's pre_quant_scale removed. No norm feeds o_proj; the norm ahead of
    q/k/v has the same width and was changed by a fold, which once 'explained' the loss."""
    m = e.pick("self_attn.o_proj")
    assert f"{m}.pre_quant_scale" in e.tensors, "the int4_awq export no longer stores o_proj's pre_quant_scale"
    del e.tensors[f"{m}.pre_quant_scale"]
    return [m]


# ---------------------------------------------------------------------------- embedding and output head
def embedding_quantized(e: Export) -> list[str]:
    """vllm-project/vllm#41365 (FP8 vocabulary embeddings: not loadable before an opt-in) and paiml/aprender#234
    (embeddings and lm_head quantized by a writer that should skip them): the input embedding stored as E4M3
    codes with a per-tensor weight_scale."""
    w = e.tensors["model.embed_tokens.weight"].float()
    scale = w.abs().max() / 448
    e.tensors["model.embed_tokens.weight"] = _fp8(w / scale)
    e.tensors["model.embed_tokens.weight_scale"] = scale.reshape(())
    return ["model.embed_tokens"]


def tied_head_copy_drifted(e: Export) -> list[str]:
    """sgl-project/sglang#2935 (quantization tools save a tied model's lm_head beside its embedding; vLLM skips it,
    others load it): a tied model's export carries lm_head.weight in bfloat16, the embedding in float32."""
    import torch

    e.tensors["lm_head.weight"] = e.tensors["model.embed_tokens.weight"].to(torch.bfloat16)
    return ["lm_head"]


def tied_head_quantized(e: Export) -> list[str]:
    """ml-explore/mlx-examples#566 (a tied model quantized with a separate, quantized output layer): the tied
    model's export carries an FP8 lm_head with scales; config.json still ties it to the embedding."""
    w = e.tensors["model.embed_tokens.weight"].float()
    scale = w.abs().max() / 448
    e.tensors["lm_head.weight"] = _fp8(w / scale)
    e.tensors["lm_head.weight_scale"] = scale.reshape(())
    return ["lm_head"]


# --------------------------------------------------------------- dtypes of the tensors kept in high precision
UNQUANTIZED_SKIP = SCALE_NAMES + ("k_scale", "v_scale")


def embedding_stored_bf16(e: Export) -> list[str]:
    """Issue 42 (an export whose embedding, in a tied model also the output head, is silently stored as bfloat16
    while the reference and every other unquantized tensor are float32; config.json still says float32): the
    values are the reference's rounded to bfloat16, so a comparison after casting the reference calls them
    unchanged."""
    import torch

    e.tensors["model.embed_tokens.weight"] = e.tensors["model.embed_tokens.weight"].to(torch.bfloat16)
    return ["model.embed_tokens"]


def cast_unquantized(e: Export, dtype, declare: str | None) -> list[str]:
    """Every unquantized float tensor (not a quantized layer's codes, not a scale) cast to `dtype`, config.json's
    dtype set to `declare` (None: left as it was); the modules cast."""
    names = [n for n, t in e.tensors.items() if t.is_floating_point() and t.element_size() > 1
             and n.rpartition(".")[2] not in UNQUANTIZED_SKIP]
    for n in names:
        e.tensors[n] = e.tensors[n].to(dtype)
    if declare is not None:
        cfg = e.json("config.json")
        cfg.pop("torch_dtype", None)
        cfg["dtype"] = declare
        e.put_json("config.json", cfg)
    return sorted({n.rpartition(".")[0] for n in names})


@dataclass(frozen=True)
class Fault:
    """A fault class: the real failure it reproduces, the healthy export it damages (precision, kv cache), how,
    the check that must report it and at which severity (an error: the audit fails; a warning: the export serves,
    but not the values the reference has)."""

    name: str
    bug: str
    base: tuple[str, str]
    corrupt: Callable[[Export], list[str]]
    check: str
    canary: bool = False  # only the logits canary can see it
    model: str = "llama"  # the tiny model it damages (qwen2: tied embeddings); the default model in the bench
    reference: bool = True  # False: found without --reference too (file- and tensor-level faults)
    severity: str = "error"  # the severity the check must report it at


FAULTS = [
    Fault("unquantized_layer", "a layer left unquantized though the config says quantized", ("fp8", "none"),
          unquantized_layer, "coverage"),
    Fault("unquantized_copy", "output identical to the input: weights copied unquantized, scales of 1",
          ("fp8", "none"), unquantized_copy, "coverage"),
    Fault("excluded_but_quantized", "lm_head (an excluded module) quantized", ("fp8", "none"), excluded_but_quantized,
          "coverage"),
    Fault("scale_zero", "weight_scale 0 (a layer that saw no calibration data)", ("fp8", "none"), scale_zero, "scales"),
    Fault("scale_negative", "negative weight_scale", ("fp8", "none"), scale_negative, "scales"),
    Fault("scale_nan", "NaN input_scale (calibration overflowed)", ("fp8", "none"), scale_nan, "scales"),
    Fault("fp8_block_scale_underflow", "NVFP4 per-block FP8 scales underflowed to 0", ("nvfp4", "none"),
          fp8_block_scale_underflow, "scales"),
    Fault("scale_subnormal", "FP8 per-tensor scale underflowed to a float32 denormal", ("fp8", "none"),
          scale_subnormal, "scales"),
    Fault("group_size_mismatch", "scale shapes do not match the declared group size", ("int4_awq", "none"),
          group_size_mismatch, "scales"),
    Fault("kv_scales_one", "FP8 KV scales all exactly 1.0", ("fp8", "fp8"), kv_scales_one, "kv_cache"),
    Fault("halved_scales", "NVFP4 export with half-sized weight scales", ("nvfp4", "none"), halved_scales, "weights"),
    Fault("scrambled_block_scales", "NVFP4 block scales out of order (dequantized cosine drops)", ("nvfp4", "fp8"),
          scrambled_block_scales, "weights"),
    Fault("dedupe_dropped", "a tied-weight dedupe dropped an untied weight", ("fp8", "none"), dedupe_dropped,
          "tensors"),
    Fault("config_changed", "config.json max_position_embeddings changed", ("fp8", "none"), config_changed,
          "metadata"),
    Fault("tokenizer_changed", "tokenizer.json differs from the reference's", ("fp8", "none"), tokenizer_changed,
          "tokenizer"),
    Fault("chat_template_changed", "chat template changed", ("fp8", "none"), chat_template_changed, "tokenizer"),
    Fault("generation_config_changed", "generation_config eos_token_id changed", ("fp8", "none"),
          generation_config_changed, "metadata"),
    Fault("algo_mismatch", "hf_quant_config says FP8, the tensors are INT8 SmoothQuant", ("int8_sq", "none"),
          algo_mismatch, "format"),
    Fault("input_scale_missing", "input quantizers never calibrated (MoE expert without tokens)", ("fp8", "none"),
          input_scale_missing, "scales"),
    Fault("fused_group_mixed_formats", "q FP8, k/v INT4 in one fused qkv group (different formats, no error)",
          ("fp8", "none"), fused_group_mixed_formats, "format"),
    Fault("activation_saturation", "activation scales 64x too small: saturate (once seen by the canary only)",
          ("fp8", "none"), activation_saturation, "activations"),
    Fault("swapped_layers", "two decoder layers swapped", ("fp8", "fp8"), swapped_layers, "weights"),
    # issue 25: activation (input) and KV scales inconsistent with the activations they quantize
    Fault("int8_input_scale_in_fp8_units", "INT8 input scales in FP8 units (amax/448): 3.5x too small",
          ("int8_sq", "none"), int8_input_scale_in_fp8_units, "activations"),
    Fault("fp8_input_scale_without_qmax", "FP8 input scales written as amax (448x too large)", ("fp8", "none"),
          fp8_input_scale_without_qmax, "activations"),
    Fault("one_layer_input_scale_too_small", "one layer's input scale 10x too small: its outliers clip",
          ("fp8", "none"), one_layer_input_scale_too_small, "activations"),
    Fault("kv_scales_too_small", "one layer's k/v scales 10x too small: K/V outliers clip", ("fp8", "fp8"),
          kv_scales_too_small, "kv_cache"),
    # what serving engines load vs what is on disk
    Fault("stale_single_file_beside_shards", "an older model.safetensors beside the shards and index",
          ("fp8", "none"), stale_single_file_beside_shards, "index", reference=False),
    Fault("index_names_missing_shard", "a shard the index names was not copied", ("fp8", "none"),
          index_names_missing_shard, "index", reference=False),
    Fault("stale_index_after_resharding", "an index of an older shard layout", ("fp8", "none"),
          stale_index_after_resharding, "index", reference=False),
    Fault("consolidated_copy_without_index", "a second safetensors file of other weights, no index",
          ("fp8", "none"), consolidated_copy_without_index, "index", reference=False),
    # tokenizer behaviour, not only its vocabulary
    Fault("tokenizer_merge_dropped", "one BPE merge dropped (vocabulary unchanged)", ("fp8", "none"),
          tokenizer_merge_dropped, "tokenizer"),
    Fault("tokenizer_decoder_dropped", "the tokenizer's decoder dropped (encoding unchanged)", ("fp8", "none"),
          tokenizer_decoder_dropped, "tokenizer"),
    # declarations that disagree
    Fault("kv_cache_scheme_disagrees", "config.json kv_cache_scheme int8, hf_quant_config.json FP8", ("fp8", "fp8"),
          kv_cache_scheme_disagrees, "declarations", reference=False),
    Fault("config_groups_disagree", "config.json config_groups of NVFP4 on an FP8 export", ("fp8", "none"),
          config_groups_disagree, "declarations", reference=False),
    Fault("kv_declared_in_one_file", "FP8 KV in hf_quant_config.json only", ("fp8", "fp8"),
          kv_declared_in_one_file, "declarations", reference=False),
    # explanations that must be right
    Fault("awq_pre_quant_scale_dropped", "o_proj's AWQ pre_quant_scale missing (no norm feeds o_proj)",
          ("int4_awq", "none"), awq_pre_quant_scale_dropped, "weights"),
    # tensor-level: embedding and output head
    Fault("embedding_quantized", "input embedding stored as FP8 codes", ("fp8", "none"), embedding_quantized,
          "head", reference=False),
    Fault("tied_head_copy_drifted", "a tied model stores lm_head in another dtype than its embedding",
          ("fp8", "none"), tied_head_copy_drifted, "head", model="qwen2", reference=False),
    Fault("tied_head_quantized", "a tied model stores a quantized lm_head", ("fp8", "none"), tied_head_quantized,
          "head", model="qwen2", reference=False),
    # issue 42: dtype drift of the tensors kept in high precision (a warning: rounded values, not broken ones)
    Fault("embedding_stored_bf16", "input embedding stored as bfloat16, the reference and the rest float32",
          ("fp8", "none"), embedding_stored_bf16, "tensors", severity="warning"),
    Fault("tied_embedding_stored_bf16", "a tied model's embedding (its output head) stored as bfloat16",
          ("fp8", "none"), embedding_stored_bf16, "tensors", model="qwen2", severity="warning"),
]


def damage(fault: Fault, healthy: Path, reference: Path, out: Path) -> list[str]:
    """A copy of the healthy export at `out`, damaged by `fault`; returns the modules it damaged."""
    shutil.copytree(healthy, out, ignore=shutil.ignore_patterns("manifest.json"))
    export = Export(out, reference)
    damaged = fault.corrupt(export)
    export.save()
    return damaged


def detection(report, fault: Fault, damaged: list[str]):
    """The finding of the fault's check, at the fault's severity, that names every damaged module, or None."""
    return next((f for f in report.findings if f.check == fault.check and f.severity == fault.severity
                 and set(damaged) <= set(f.modules)), None)


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def exports(tiny_llama, tiny_qwen2, shared_cache, tmp_path_factory):
    """(precision, kv[, model][, dtype]) -> a healthy export of the tiny Llama (or, model="qwen2", the tiny tied
    Qwen2) made by quantlab's own pipeline (made once); dtype: model.dtype= (the float32 models loaded, calibrated
    and exported in bfloat16, as on a GPU), default the device's (float32 on a CPU)."""
    runs: dict[tuple, Path] = {}
    models = {"llama": tiny_llama, "qwen2": tiny_qwen2}

    def get(precision: str, kv: str, model: str = "llama", dtype: str | None = None) -> Path:
        key = ((precision, kv) if model == "llama" else (precision, kv, model)) + ((dtype,) if dtype else ())
        if key not in runs:
            run_dir = tmp_path_factory.mktemp(f"export_{precision}_{kv}_{model}{'_' + dtype if dtype else ''}")
            block = ["precision.block_size=32"] if "awq" in precision else []
            block += [f"model.dtype={dtype}"] if dtype else []
            code = run_api([f"+precision={precision}", f"kv_cache={kv}", f"model.path={models[model]}",
                            f"cache_dir={shared_cache}", "stop_after=export", *EXPORT_FAST, *block], run_dir)
            assert code == 0
            runs[key] = run_dir
        return (runs[key] / "checkpoint").resolve()

    get.models = models

    get.runs = runs
    return get


# --------------------------------------------------------------------------------------------- healthy
@pytest.mark.parametrize("precision,kv", HEALTHY)
def test_healthy_exports_have_no_error(precision, kv, exports, tiny_llama):
    from quantlab.audit import audit

    report = audit(exports(precision, kv), tiny_llama)
    assert report.errors == [], report.render()
    assert report.warnings == [], report.render()
    assert report.canary is not None and report.canary["top1"] > 0.85
    assert {r["module"] for r in report.layers} == {f"model.layers.{i}.{m}" for i in (0, 1) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    assert report.quant_algo == {"fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "int4_awq": "W4A16_AWQ",
                                 "w4a8_awq": "W4A8_AWQ", "nvfp4": "NVFP4"}[precision]
    coverage = report.find("coverage", "info")[0].message
    assert "lm_head 1/1 high precision" in coverage
    if "awq" in precision:  # AWQ scales folded into the norms: recognised, not reported as damage
        assert report.find("tensors", "info") and all(r["fold"] for r in report.layers if "q_proj" in r["module"])


def test_healthy_export_statistics(exports, tiny_llama):
    """The probe's figures on a healthy export: every static input scale and KV scale has a row, the norms feeding
    q/k/v and gate/up are found by comparing tensors (not by name), and every check is timed."""
    from quantlab.audit import audit

    report = audit(exports("fp8", "fp8"), tiny_llama, canary=False)
    inputs = [r for r in report.activations if r["kind"] == "input"]
    assert len(inputs) == 14 and all(0.05 < r["ratio"] < 2 for r in inputs), inputs
    kv = [r for r in report.activations if r["kind"] in ("k", "v")]
    assert len(kv) == 4 and all(0.05 < r["ratio"] < 2 for r in kv), kv
    assert {"index", "declarations", "tokenizer", "head", "probe", "activations"} <= set(report.timings)
    awq = audit(exports("int4_awq", "none"), tiny_llama, canary=False)
    folds = {r["module"]: r["fold"] for r in awq.layers}
    assert folds["model.layers.1.self_attn.q_proj"] == "model.layers.1.input_layernorm.weight"
    assert folds["model.layers.1.mlp.up_proj"] == "model.layers.1.post_attention_layernorm.weight"
    assert folds["model.layers.1.self_attn.o_proj"] == "pre_quant_scale"


def _outlier_layer(exports, tiny_llama, tmp_path) -> tuple[Export, str]:
    """A healthy int4_awq export and a copy of its reference in which one smoothed layer (the last o_proj) is as
    hard as int4 gets: in the quantizer's space (the weight divided by its pre_quant_scale) every group of 32 inputs
    holds one weight A and 31 just under half a quantization step (0.07 A), which round-to-nearest zeroes; that
    layer re-quantized as the format does. An export consistent with its reference whose layer carries far more
    error than the format's general bounds (SQNR ~8.8 dB against the W4 bound of 9.5)."""
    import torch
    from safetensors.torch import load_file, save_file

    ref = tmp_path / "reference"
    shutil.copytree(tiny_llama, ref)
    out = tmp_path / "export"
    shutil.copytree(exports("int4_awq", "none"), out, ignore=shutil.ignore_patterns("manifest.json"))
    e = Export(out, ref)
    m = e.pick("self_attn.o_proj")
    pqs = e.tensors[f"{m}.pre_quant_scale"].float()
    rows, cols = e.ref(f"{m}.weight").shape
    gen = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (rows, cols), generator=gen).float() * 2 - 1
    space = 0.07 * signs
    big = torch.randint(0, 32, (rows, cols // 32), generator=gen) + torch.arange(0, cols, 32)[None, :]
    space.scatter_(1, big, signs.gather(1, big))
    space = space * float(e.ref(f"{m}.weight").float().abs().max())
    for f in sorted(ref.glob("*.safetensors")):
        tensors = load_file(str(f))
        if f"{m}.weight" in tensors:
            tensors[f"{m}.weight"] = (space * pqs[None, :]).to(tensors[f"{m}.weight"].dtype)
            save_file(tensors, str(f), metadata={"format": "pt"})
    scale_dtype = e.tensors[f"{m}.weight_scale"].dtype
    codes, scales = _int4_rtn(space, 32)
    e.tensors[f"{m}.weight"], e.tensors[f"{m}.weight_scale"] = codes, scales.to(scale_dtype)
    e.save()
    return e, m


def test_a_layer_as_good_as_its_format_allows_is_a_warning(exports, tiny_llama, tmp_path):
    """An outlier-heavy layer quantized consistently (Gemma-3-270M's w4a8_awq MLPs of layers 15-16 on an H100: SQNR
    8.3-9.4 dB against the W4 bound of 9.5, three audit errors and nothing evaluated) is as good as the format's own
    round-to-nearest of the same smoothed weights: a warning naming it, no error. The same layer without its
    pre_quant_scale is still an error: the scale is what the weights need and the export lacks."""
    from quantlab.audit import audit

    e, m = _outlier_layer(exports, tiny_llama, tmp_path)
    report = audit(e.path, e.reference, canary=False)
    row = next(r for r in report.layers if r["module"] == m)
    assert row["sqnr_db"] < 9.5 and row["format_rtn"]["sqnr_db"] < 9.5, row  # beyond the bound, as RTN is
    assert report.errors == [], report.render()
    assert any(m in f.modules and "round-to-nearest" in f.message for f in report.warnings), report.render()
    scales = e.tensors[f"{m}.weight_scale"].clone()
    e.tensors[f"{m}.weight_scale"] = scales * 0.85  # a constant scale error: cosine and spread do not see it
    e.save()
    off = audit(e.path, e.reference, canary=False)
    assert any(m in f.modules and "constant factor" in f.message for f in off.errors), off.render()
    e.tensors[f"{m}.weight_scale"] = scales
    del e.tensors[f"{m}.pre_quant_scale"]
    e.save()
    broken = audit(e.path, e.reference, canary=False)  # the layer's own comparison, not only its role's consistency
    assert any(m in f.modules and f.check == "weights" and
               ("per input channel" in f.message or "dequantize" in f.message) for f in broken.errors), \
        broken.render()


def test_tied_model_export_is_clean(exports, tiny_qwen2):
    from quantlab.audit import audit

    report = audit(exports("fp8", "none", "qwen2"), tiny_qwen2, canary=False)
    assert report.errors == [] and report.warnings == [], report.render()


@pytest.mark.parametrize("precision,model", [("fp8", "llama"), ("int4_awq", "llama"), ("fp8", "qwen2")])
def test_healthy_bfloat16_export_of_a_float32_model(precision, model, exports):
    """quantlab's own export of the float32 tiny model loaded in bfloat16 (model.dtype=bfloat16, the default on a
    GPU): every unquantized tensor is stored as bfloat16 and config.json declares bfloat16. The dtype drift is
    reported as info naming every module it concerns, never as a warning or an error (AWQ's folded norms too)."""
    from quantlab.audit import audit

    reference = exports.models[model]
    ckpt = exports(precision, "none", model, "bfloat16")
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "bfloat16"
    report = audit(ckpt, reference, canary=False)
    assert report.errors == [] and report.warnings == [], report.render()
    drift = [f for f in report.find("tensors", "info") if "the dtype config.json declares" in f.message]
    assert len(drift) == 1 and "bfloat16 where the reference has float32" in drift[0].message, report.render()
    e = Export(ckpt, reference)
    quantized = {f"{m}.weight" for m in e.modules()}
    kept = {n.rpartition(".")[0] for n in e.ref_names() - quantized}  # norms, embedding, head, biases
    assert set(drift[0].modules) == kept and "model.embed_tokens" in kept, (drift[0].modules, kept)


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_embedding_stored_bf16_is_a_warning_naming_it(model, exports, tmp_path):
    """The embedding alone in bfloat16 (issue 42): one tensors warning naming the embedding, with the stored and the
    reference's dtype, the relative change the cast made (the measured one) and what engines load; the audit passes
    (rounded values, not broken ones) and nothing else warns. In the tied Qwen2 the warning says the table is also
    the output head (head.py, which compares a stored head copy with the embedding, has nothing to add)."""
    import torch

    from quantlab.audit import audit

    fault = next(f for f in FAULTS if f.corrupt is embedding_stored_bf16 and f.model == model)
    out = tmp_path / fault.name
    reference = exports.models[model]
    damage(fault, exports(*fault.base, model), reference, out)
    report = audit(out, reference, canary=False)
    assert report.passed and [f.check for f in report.warnings] == ["tensors"], report.render()
    w = report.warnings[0]
    assert w.modules == ["model.embed_tokens"], w.modules
    assert "stored as bfloat16 where the reference has float32 (model.embed_tokens.weight" in w.message, w.message
    assert "config.json declares float32" in w.message and "keep the reference's float32" in w.message, w.message
    x = Export(out, reference).ref("model.embed_tokens.weight")
    rel = float((x - x.to(torch.bfloat16).float()).norm() / x.norm())
    shown = float(re.search(r"relative change ([0-9.e-]+)\)", w.message).group(1))
    assert 0 < rel < 2.0 ** -8 and abs(shown - rel) <= 5e-3 * rel, (shown, rel)  # shown to 3 digits
    assert "vLLM" in w.consequence and "stored dtype" in w.consequence and "float32" in w.fix
    assert ("output head" in w.message) == (model == "qwen2"), w.message
    assert not report.find("head", "error") and not report.find("head", "warning"), report.render()


def test_dtype_of_the_whole_export(exports, tiny_llama, tmp_path):
    """A cast of every unquantized tensor: to bfloat16 with config.json declaring bfloat16 is info (what engines
    serve anyway); the same cast under config.json's float32 is a warning; to float16, where a reference value lies
    beyond float16's 65504, is an error naming the tensor that overflowed to inf, though config.json declares
    float16 and the other tensors are info. The same large value kept in float32 is no finding."""
    import torch
    from safetensors.torch import load_file, save_file

    from quantlab.audit import audit

    healthy = exports("fp8", "none")

    def audited(name: str, reference: Path, corrupt) -> tuple:
        out = tmp_path / name
        shutil.copytree(healthy, out, ignore=shutil.ignore_patterns("manifest.json"))
        e = Export(out, reference)
        cast = corrupt(e)
        e.save()
        return audit(out, reference, canary=False), cast

    report, cast = audited("bf16_declared", tiny_llama, lambda e: cast_unquantized(e, torch.bfloat16, "bfloat16"))
    assert report.errors == [] and report.warnings == [], report.render()
    info = [f for f in report.find("tensors", "info") if "bfloat16, the dtype config.json declares" in f.message]
    assert info and set(info[0].modules) == set(cast) and len(cast) == 7, (cast, report.render())

    report, cast = audited("bf16_undeclared", tiny_llama, lambda e: cast_unquantized(e, torch.bfloat16, None))
    assert report.errors == [] and [f.check for f in report.warnings] == ["tensors"], report.render()
    assert set(report.warnings[0].modules) == set(cast) and "declares float32" in report.warnings[0].message

    big = tmp_path / "reference_with_a_large_norm"  # a final-norm value float32 holds and float16 does not
    shutil.copytree(tiny_llama, big)
    weights = load_file(str(big / "model.safetensors"))
    weights["model.norm.weight"][3] = 1e5
    save_file(weights, str(big / "model.safetensors"), metadata={"format": "pt"})

    def large(e: Export) -> list[str]:
        e.tensors["model.norm.weight"] = e.ref("model.norm.weight")
        return ["model.norm"]

    def large_in_float16(e: Export) -> list[str]:
        large(e)
        return cast_unquantized(e, torch.float16, "float16")

    report, _ = audited("large_kept", big, large)
    assert report.errors == [] and report.warnings == [], report.render()
    report, cast = audited("fp16_overflow", big, large_in_float16)
    errors = [f for f in report.errors if f.check == "tensors"]
    assert len(report.errors) == 1 and errors and errors[0].modules == ["model.norm"], report.render()
    assert "inf" in errors[0].message and "65504" in errors[0].message and "float16" in errors[0].message
    assert errors[0].consequence and errors[0].fix
    info = [f for f in report.find("tensors", "info") if "float16, the dtype config.json declares" in f.message]
    assert info and set(info[0].modules) == set(cast) - {"model.norm"}, report.render()


def test_checks_without_the_reference(exports, tmp_path):
    """Without --reference: a tokenizer that no longer decodes what it encodes is a warning (it cannot be told from
    a normalizing tokenizer without the original), and layers that share one input but carry different input scales
    are a warning naming them; the activation checks that need the reference's activations say they were skipped."""
    from quantlab.audit import audit

    fault = next(f for f in FAULTS if f.name == "tokenizer_decoder_dropped")
    damage(fault, exports(*fault.base), exports.models["llama"], tmp_path / "tok")
    report = audit(tmp_path / "tok", None, canary=False)
    assert report.errors == [] and [f.check for f in report.warnings] == ["tokenizer"], report.render()
    assert "decode" in report.warnings[0].message and report.warnings[0].fix

    out = tmp_path / "shared"
    shutil.copytree(exports("fp8", "none"), out, ignore=shutil.ignore_patterns("manifest.json"))
    e = Export(out, exports.models["llama"])
    q = e.pick("self_attn.q_proj")
    e.tensors[f"{q}.input_scale"] = e.tensors[f"{q}.input_scale"] * 2
    e.save()
    report = audit(out, None, canary=False)
    shared = [f for f in report.warnings if f.check == "activations"]
    assert report.errors == [] and shared and q in shared[0].modules, report.render()
    assert any(s.startswith("activations:") for s in report.skipped)


def _rearranged(healthy: Path, out: Path, how: str) -> None:
    """A healthy export rearranged without changing what any engine loads."""
    import random

    from safetensors.torch import save_file

    shutil.copytree(healthy, out, ignore=shutil.ignore_patterns("manifest.json"))
    e = Export(out, out)
    names = list(e.tensors)
    random.Random(0).shuffle(names)
    if how == "resharded":
        e.save_sharded(3, order=names)
        (out / "README.md").write_text("# an export\n")
        save_file({"adapter.lora_a": e.tensors[names[0]].float().contiguous()}, str(out / "adapter_extra.safetensors"))
    elif how == "reordered":
        (out / "model.safetensors").unlink()
        save_file({k: e.tensors[k].contiguous() for k in names}, str(out / "model.safetensors"))
        (out / "notes.txt").write_text("calibrated on pydoc\n")
        (out / "training_args.json").write_text("{}")
    elif how == "duplicate_beside_shards":
        single = dict(e.tensors)
        e.save_sharded(2)
        save_file({k: v.contiguous() for k, v in single.items()}, str(out / "model.safetensors"))


@pytest.mark.parametrize("how", ["resharded", "reordered", "duplicate_beside_shards"])
def test_neutral_rearrangements_raise_nothing(how, exports, tiny_llama, tmp_path):
    """Re-sharded (with a correct index, an unrelated file beside it), reordered, extra unrelated files, an
    identical single file beside the shards: no error, no warning, with or without the reference."""
    from quantlab.audit import audit

    _rearranged(exports("int8_sq", "none"), tmp_path / how, how)
    for reference in (tiny_llama, None):
        report = audit(tmp_path / how, reference, canary=False)
        assert report.errors == [] and report.warnings == [], report.render()


def test_healthy_export_without_reference(exports):
    """Without a reference the checks that need it are skipped, and the report says so."""
    from quantlab.audit import audit

    report = audit(exports("int4_awq", "none"), None)
    assert report.errors == [] and report.canary is None and report.layers == []
    assert any("no reference model given" in f.message for f in report.find("weights", "info"))
    assert any(s.startswith("canary") for s in report.skipped)


# --------------------------------------------------------------------- the 4-bit layers the audit reads with
def test_w4a8_engine_matches_modelopt_fakequant(exports, tiny_llama):
    """engine=torch's W4A8_AWQ layers (QLAYERS) against ModelOpt's own fake-quant model as export leaves it
    (requantize_resmooth_fused_llm_layers): top-1 agreement >= 0.99 on held-out text."""
    import torch
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    from quantlab.artifacts import Artifact
    from quantlab.audit.canary import _canary_ids
    from quantlab.engines.torch_engine import load_exported
    from quantlab.env import resolve_device
    from quantlab.gate.metrics import compare_positions
    from quantlab.models import ModelRef, load_tokenizer
    from quantlab.stages.quantize import restore

    ckpt = exports("w4a8_awq", "none")
    qpath = Path(json.loads((exports.runs[("w4a8_awq", "none")] / "run.json").read_text())
                 ["artifacts"]["quantize"]["path"])
    ref = ModelRef.from_path(tiny_llama)
    device = resolve_device("cpu")
    fakequant = restore(Artifact("quantize", qpath.name, qpath, json.loads((qpath / "manifest.json").read_text())),
                        ref, device, torch.float32)
    requantize_resmooth_fused_llm_layers(fakequant)
    engine, plan = load_exported(ckpt, device, torch.float32)
    assert plan["formats"] == {"W4A8_AWQ": 14}
    ids = _canary_ids(load_tokenizer(ref), 4, 64)
    with torch.no_grad():
        a, b = fakequant(ids).logits, engine(ids).logits
    cmp = compare_positions(a[:, :-1], b[:, :-1], ids[:, 1:])
    assert float((cmp["argmax_ref"] == cmp["argmax_cand"]).float().mean()) >= 0.99
    assert float(cmp["kl"].mean()) < 1e-4


def test_nvfp4_layer_matches_modelopt_numerics(exports):
    """The NVFP4 layer's dequantized weight equals ModelOpt's own NVFP4 dequantization bit for bit, and its dynamic
    activation quantization (blocks of 16, the exported input_scale as global scale) equals ModelOpt's NVFP4
    quantize + dequantize round trip."""
    import torch
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from quantlab.checkpoint import CheckpointTensors, read_quant_config
    from quantlab.engines.qlayers import QLAYERS, LayerContext, nvfp4_qdq

    ckpt = exports("nvfp4", "none")
    t, quant = CheckpointTensors(ckpt), read_quant_config(ckpt)
    ctx = LayerContext("cpu", False, torch.float32)
    layers = [n[: -len(".weight_scale")] for n in t.names() if n.endswith(".weight_scale")]
    assert len(layers) == 14
    for name in layers:
        out_f, half_in = t.shape_of(f"{name}.weight")
        layer = QLAYERS["NVFP4"].from_checkpoint(name, out_f, half_in * 2, False, t, quant.format_of(name), ctx)
        theirs = NVFP4QTensor(torch.Size([out_f, half_in * 2]), torch.float32, t.get(f"{name}.weight")).dequantize(
            torch.float32, scale=t.get(f"{name}.weight_scale"), double_scale=t.get(f"{name}.weight_scale_2"),
            block_sizes={-1: 16})
        assert torch.equal(layer.dequantized_weight(), theirs), name
    global_scale = t.get(f"{layers[-1]}.input_scale").float()
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75, -3.5, 0, 0, 0, 0, 0, 0]) * 8
    packed, block_scales, _ = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=global_scale)
    theirs = packed.dequantize(torch.float32, scale=block_scales, double_scale=global_scale, block_sizes={-1: 16})
    assert torch.equal(nvfp4_qdq(x, global_scale), theirs)


# ----------------------------------------------------------------------------------------------- faults
def test_fault_catalogue_covers_the_issue():
    """Every check has a fault of its own; issue 25's classes (activation scales, what engines load, tokenizer
    behaviour, declarations, fold explanations, embedding / head) each have cases, none left to the canary."""
    assert len({f.name for f in FAULTS}) == len(FAULTS) >= 39
    assert {f.check for f in FAULTS} >= {"coverage", "scales", "kv_cache", "weights", "tensors", "metadata", "format",
                                         "index", "declarations", "tokenizer", "activations", "head"}
    assert not [f for f in FAULTS if f.canary]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_is_detected(fault, exports, tmp_path):
    """With the reference and without the canary: found by its own check, at its severity (an error, or a warning
    for a fault that must not fail the audit), naming what it damaged, with what an engine would do and the fix."""
    from quantlab.audit import audit

    reference = exports.models[fault.model]
    out = tmp_path / fault.name
    damaged = damage(fault, exports(*fault.base, fault.model), reference, out)
    report = audit(out, reference, canary=fault.canary)
    found = detection(report, fault, damaged)
    assert found is not None, f"{fault.name}: no {fault.check} {fault.severity} naming {damaged}\n{report.render()}"
    assert found.cause and found.message and found.consequence and found.fix
    assert all(f.consequence and f.fix for f in report.errors + report.warnings), report.render()
    if fault.severity != "error":
        assert report.passed, report.render()


@pytest.mark.parametrize("fault", [f for f in FAULTS if not f.reference], ids=lambda f: f.name)
def test_file_level_fault_is_detected_without_reference(fault, exports, tmp_path):
    """Faults in the files and tensors alone are found with neither --reference nor the canary."""
    from quantlab.audit import audit

    out = tmp_path / fault.name
    damaged = damage(fault, exports(*fault.base, fault.model), exports.models[fault.model], out)
    report = audit(out, None, canary=False)
    assert detection(report, fault, damaged) is not None, report.render()


def test_damage_is_reported_with_its_numbers(exports, tiny_llama, tmp_path):
    """Halved NVFP4 scales: gain 2 (the factor that maps the weights back onto the reference), SQNR ~6 dB."""
    from quantlab.audit import audit

    fault = next(f for f in FAULTS if f.name == "halved_scales")
    damage(fault, exports(*fault.base), tiny_llama, tmp_path / "halved")
    report = audit(tmp_path / "halved", tiny_llama, canary=False)
    assert all(abs(r["gain"] - 2.0) < 0.05 and r["sqnr_db"] < 7 for r in report.layers)
    gain = [f for f in report.find("weights", "error") if "constant factor" in f.message]
    assert gain and re.search(r"gain (1\.9[5-9]|2\.0[0-5])", gain[0].message), gain


def test_swapped_layers_fail_the_canary_too(exports, tiny_llama, tmp_path):
    from quantlab.audit import audit

    fault = next(f for f in FAULTS if f.name == "swapped_layers")
    damage(fault, exports(*fault.base), tiny_llama, tmp_path / "swapped")
    report = audit(tmp_path / "swapped", tiny_llama)
    assert report.find("canary", "error") and report.canary["top1"] < 0.7


# ------------------------------------------------------------------------------------------- report API
def test_report_round_trip_and_rendering(exports, tiny_llama, tmp_path):
    from quantlab.audit import AuditReport, abbreviate, audit

    fault = next(f for f in FAULTS if f.name == "group_size_mismatch")
    damage(fault, exports(*fault.base), tiny_llama, tmp_path / "g")
    report = audit(tmp_path / "g", tiny_llama, canary=False)
    again = AuditReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.to_dict() == report.to_dict() and not again.passed
    text = report.render()
    assert "ERRORS (" in text and "likely cause:" in text and "model.layers.{0-1}.mlp.down_proj (2)" in text
    assert "in deployment:" in text and "fix:" in text
    assert "'" not in abbreviate(["model.layers.0.mlp.down_proj"])  # plain names, never repr()
    assert abbreviate([f"model.layers.{i}.mlp.down_proj" for i in range(30)] + ["lm_head"]) == \
        "lm_head; model.layers.{0-29}.mlp.down_proj (30)"
    assert abbreviate(["a.1.b", "a.0.b"]) == "a.0.b, a.1.b"


# ------------------------------------------------------------------------------------------------- CLI
def _cli(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return run_module("quantlab.audit", args, REPO, cli_env(), timeout)


def test_cli_exit_codes_healthy_and_damaged(exports, tiny_llama, tmp_path):
    healthy = _cli([exports("fp8", "fp8"), "--reference", tiny_llama, "--json", tmp_path / "ok.json"])
    assert healthy.returncode == 0, healthy.stderr
    assert "quantlab audit: PASS" in healthy.stdout and "Traceback" not in healthy.stderr
    doc = json.loads((tmp_path / "ok.json").read_text())
    assert doc["passed"] and doc["summary"]["error"] == 0 and doc["canary"]["positions"] == 254
    fault = next(f for f in FAULTS if f.name == "scale_nan")
    damaged = damage(fault, exports(*fault.base), tiny_llama, tmp_path / "nan")
    broken = _cli([tmp_path / "nan", "--reference", tiny_llama, "--no-canary"])
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "ERRORS (" in broken.stdout and damaged[0] in broken.stdout and "Traceback" not in broken.stderr
    assert "in deployment:" in broken.stdout and "fix:" in broken.stdout


def test_cli_unusable_input_exits_2(exports, tiny_llama, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(exports("fp8", "none"), corrupt)
    with open(corrupt / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 16)
    cases = [
        ([tmp_path / "nowhere"], "does not exist"),
        ([tiny_llama], "hf_quant_config.json"),
        ([corrupt], "not a readable safetensors file"),
        ([exports("fp8", "none"), "--reference", tmp_path / "nowhere"], "reference"),
        ([exports("fp8", "none"), "--reference", exports("fp8", "fp8")], "already a quantized checkpoint"),
    ]
    for args, words in cases:
        out = _cli([*args, "--no-canary"], timeout=120)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert out.stderr.startswith("quantlab: error: ") and words in out.stderr, out.stderr
        assert "fix:" in out.stderr and "Traceback" not in out.stderr


def test_cli_interrupt_exits_130(monkeypatch, capsys, exports):
    import quantlab.audit.__main__ as audit_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(audit_module, "audit", interrupted)
    assert audit_module.main([str(exports("fp8", "none"))]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "quantlab audit: interrupted"


# ------------------------------------------------------------------------------------------------ step
def test_audit_step_is_cached_and_audits_external_checkpoints(exports, tiny_llama, shared_cache, tmp_path,
                                                              monkeypatch):
    from conftest import compose

    from quantlab.graph import Executor, steps_for
    from quantlab.pipeline import context
    from quantlab.stages import audit as audit_stage

    def audited(overrides: list[str]):
        cfg = compose([f"model.path={tiny_llama}", f"cache_dir={shared_cache}", "stop_after=export", *FAST,
                       *overrides])[0]
        ctx = context(cfg)
        step = audit_stage.step(ctx)
        assert (step.name, step.stage, step.directory) == ("audit", "export", "audit")
        assert step.needs == ("export", "prepare", "data:eval")  # the canary reads the evaluation's prefix
        steps = steps_for(ctx)
        assert [s.name for s in steps].index("audit") == [s.name for s in steps].index("export") + 1
        run = Executor(ctx, steps)
        return run.value("audit"), ctx.store.events

    report, events = audited(["+precision=fp8", "kv_cache=fp8"])
    assert report.passed and report.canary is not None
    report, events = audited(["+precision=fp8", "kv_cache=fp8"])
    assert [a for s, _, a in events if s == "audit"] == ["reused"] and report.passed
    assert len(audit_stage.audit_code()) == 16
    monkeypatch.setattr(audit_stage, "audit_code", lambda: "other audit code")  # a fix in quantlab/audit: audited anew
    report, events = audited(["+precision=fp8", "kv_cache=fp8"])
    assert [a for s, _, a in events if s == "audit"] == ["built"] and report.passed
    monkeypatch.undo()
    fault = next(f for f in FAULTS if f.name == "kv_scales_one")
    damage(fault, exports(*fault.base), tiny_llama, tmp_path / "ext")
    report, _ = audited(["+precision=fp8", "kv_cache=fp8", f"engine.checkpoint={tmp_path / 'ext'}"])
    assert not report.passed and report.find("kv_cache", "error")


def test_pipeline_stops_on_an_audit_error_before_evaluating(exports, tiny_llama, shared_cache, tmp_path):
    """engine.checkpoint= a damaged export: exit 1 with the finding in report.md / report.html / junit.xml, no
    evaluation (no metrics.json, no evaluate artifact built), the reports of this run and no other."""
    import xml.etree.ElementTree as ET

    from conftest import read_json, run_cli

    fault = next(f for f in FAULTS if f.name == "scale_nan")
    damaged = damage(fault, exports(*fault.base), tiny_llama, tmp_path / "ext")
    res = run_cli(["+precision=fp8", f"model.path={tiny_llama}", f"engine.checkpoint={tmp_path / 'ext'}", *FAST,
                   "hydra.run.dir=outputs/r"], cwd=tmp_path, cache=shared_cache)
    assert res.returncode == 1, res.stderr[-3000:]
    run = tmp_path / "outputs" / "r"
    assert "checkpoint audit found" in res.stdout and not (run / "metrics.json").exists()
    md = (run / "report.md").read_text()
    from quantlab.report.render import md_escape

    assert "FAIL" in md and "nothing was evaluated" in md and md_escape(damaged[0]) in md
    assert "nothing was evaluated" in (run / "report.html").read_text()
    suite = ET.parse(run / "junit.xml").getroot().find("testsuite")
    assert int(suite.get("failures")) >= 1
    record = read_json(run / "run.json")
    assert record["exit_code"] == 1 and record["audit"]["passed"] is False
    assert not [e for e in record["events"] if e["stage"] == "evaluate" and e["action"] == "built"]
    # a healthy checkpoint of the same run passes its audit and the report says so
    res = run_cli(["+precision=fp8", f"model.path={tiny_llama}", *FAST, "hydra.run.dir=outputs/ok"], cwd=tmp_path,
                  cache=shared_cache)
    assert res.returncode in (0, 1), res.stderr[-3000:]
    doc = read_json(tmp_path / "outputs" / "ok" / "metrics.json")
    assert doc["run"]["audit"]["passed"] is True
    assert "Checkpoint audit: passed" in (tmp_path / "outputs" / "ok" / "report.md").read_text()


def test_audit_reports_carry_consequence_and_fix_escaped(tmp_path):
    """report.md / report.html / junit.xml of a stopped run show each finding's consequence and fix; text from the
    model or the checkpoint (module names, messages) cannot inject Markdown or HTML."""
    from quantlab.audit import AuditReport, Finding
    from quantlab.report.audit import write_audit_reports

    hostile = "<script>alert(1)</script> | ![x](http://e/x.png) **bold**"
    report = AuditReport("/ckpt", "/ref", "FP8", None, [Finding(
        "error", "activations", [f"model.layers.0.{hostile}"], f"ratio 9.1 {hostile}", f"cause {hostile}",
        consequence=f"engines clip {hostile}", fix=f"recalibrate {hostile}")], {"total": 1.0})
    write_audit_reports(tmp_path, report, "m<b>", "fp8", "none")
    md, html = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "what a serving engine does with it" in md and "engines clip" in md and "recalibrate" in md
    assert "<script>" not in md and "![x]" not in md and "| ![" not in md
    assert "engines clip" in html and "recalibrate" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    junit = (tmp_path / "junit.xml").read_text()
    assert "in deployment: engines clip" in junit and "fix: recalibrate" in junit
    assert json.loads((tmp_path / "audit.json").read_text())["findings"][0]["fix"].startswith("recalibrate")
