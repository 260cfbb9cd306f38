"""GGUF files (llama.cpp) of Llama-architecture models, read with quantlab's own parser (header, metadata, tensor
table, all bounds checked before anything is read) and presented under Hugging Face names.

    token_embd -> model.embed_tokens     output -> lm_head (absent: tied to the embedding)   output_norm -> model.norm
    blk.N.attn_q / attn_k / attn_v / attn_output -> model.layers.N.self_attn.{q,k,v,o}_proj
    blk.N.ffn_gate / ffn_up / ffn_down -> model.layers.N.mlp.{gate,up,down}_proj
    blk.N.attn_norm / ffn_norm -> model.layers.N.{input,post_attention}_layernorm

Quantized Linear weights are handed out as their raw rows of blocks (U8 [out, row bytes]) for the GGUF_<TYPE> layer
classes; q and k rows are un-permuted (llama.cpp's converter interleaves the two RoPE halves of every head: its
reshape(heads, 2, rows / heads / 2, in).swapaxes(1, 2) is undone, as transformers' GGUF loader does). Quantized
tensors that are not Linear weights (the token embedding, often Q8_0 or Q6_K) are handed out dequantized.
The model config comes from the llama.* metadata; the tokenizer stays in the file (tokenizer.ggml.*), checked
against the reference's token by token when the two are paired."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

from quantlab.checkpoint import CheckpointTensors
from quantlab.errors import QuantlabError
from quantlab.formats import ggml
from quantlab.formats.base import CheckpointFormat, ForeignLayer, Opened, declared, refuse

MAGIC = b"GGUF"
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
              18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
              26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
FIX = "quantlab reads GGUF files of Llama-architecture models in F32/F16/BF16, Q8_0, Q4_0/1, Q5_0/1 and Q2_K-Q6_K"


class _Reader:
    """Little-endian reads over the file's bytes, every read bounds-checked."""

    def __init__(self, data: memoryview, file: Path):
        self.data, self.pos, self.file = data, 0, file

    def bad(self, why: str) -> QuantlabError:
        return QuantlabError(f"{self.file.name} is not a readable GGUF file ({why})",
                             fix="re-download or re-convert the GGUF file")

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise self.bad(f"it ends inside its header at byte {len(self.data)}")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.data):
            raise self.bad("a string runs past the end of the file")
        raw = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0):
        if kind in SCALARS:
            return self.scalar(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY and depth < 2:
            inner, n = self.scalar("<I"), self.scalar("<Q")
            if n > len(self.data):
                raise self.bad("an array longer than the file")
            return [self.value(inner, depth + 1) for _ in range(n)]
        raise self.bad(f"unknown metadata value type {kind}")


def parse(file: Path) -> tuple[dict, dict[str, dict], int]:
    """(metadata, tensor name -> {type, shape (ne, innermost first), offset, bytes}, data section start). Every
    tensor lies inside the file; a damaged or hostile header is a QuantlabError naming the file."""
    with open(file, "rb") as f:
        data = memoryview(f.read())
    r = _Reader(data, file)
    if bytes(data[:4]) != MAGIC:
        raise r.bad("it does not start with GGUF")
    r.pos = 4
    version = r.scalar("<I")
    if version not in (2, 3):
        raise r.bad(f"GGUF version {version}; quantlab reads versions 2 and 3")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    if n_tensors > len(data) or n_kv > len(data):
        raise r.bad("counts larger than the file")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.scalar("<I"))
    tensors = {}
    for _ in range(n_tensors):
        name = r.string()
        dims = r.scalar("<I")
        if dims > 4:
            raise r.bad(f"tensor {name[:80]!r} has {dims} dimensions")
        shape = [r.scalar("<Q") for _ in range(dims)]
        kind, offset = r.scalar("<I"), r.scalar("<Q")
        tensors[name] = {"type": GGML_TYPES.get(kind, f"type {kind}"), "shape": shape, "offset": offset}
    align = meta.get("general.alignment", 32)
    if type(align) is not int or align <= 0:
        raise r.bad(f"general.alignment={align!r}")
    start = -(-r.pos // align) * align
    for name, entry in tensors.items():
        entry["bytes"] = _nbytes(entry, name, file)
        if entry["bytes"] is not None and start + entry["offset"] + entry["bytes"] > len(data):
            raise QuantlabError(f"{file.name} is truncated or corrupt: tensor {name} ends past the end of the file",
                                fix="re-download or re-convert the GGUF file")
    return meta, tensors, start


def _nbytes(entry: dict, name: str, file: Path) -> int | None:
    """Bytes of a tensor of a type quantlab reads (None for other types: refused by name when used)."""
    kind, shape = entry["type"], entry["shape"]
    count = 1
    for d in shape:
        count *= d
    if kind in FLOAT_BYTES:
        return count * FLOAT_BYTES[kind]
    if kind in ggml.BLOCKS:
        values, size = ggml.BLOCKS[kind]
        if not shape or shape[0] % values:
            raise QuantlabError(f"{file.name}: tensor {name} ({kind}) has rows of {shape[0] if shape else 0} "
                                f"values, not whole blocks of {values}", fix="re-convert the GGUF file")
        return count // values * size
    return None


def hf_name(name: str) -> str | None:
    """The Hugging Face tensor name of a llama GGUF tensor (None: not one quantlab maps)."""
    if name in NAMES:
        return NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)", name)
    if m and m.group(2) in BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


class GgufTensors(CheckpointTensors):
    """The tensors of a GGUF file under Hugging Face names (CheckpointTensors' interface: names, dtype_of, shape_of,
    get, optional; `where` maps every name to this object, whose get_tensor reads it)."""

    def __init__(self, file: Path, meta: dict, table: dict[str, dict], start: int):
        self.ckpt, self.file, self.start, self.meta = file, file, start, meta
        self.heads = int(meta.get("llama.attention.head_count", 0))
        self.kv_heads = int(meta.get("llama.attention.head_count_kv", self.heads))
        self.headers, self.where, self.source, self.types, self.dequantize_on_read = {}, {}, {}, {}, set()
        for gname, entry in table.items():
            name = hf_name(gname)
            if name is None:
                raise refuse(file, f"tensor {gname} ({entry['type']}) has no place in a Llama model quantlab "
                             "builds (rope_freqs: Llama 3.1 RoPE scaling, which quantlab does not map)", FIX)
            kind = entry["type"]
            if entry["bytes"] is None:
                raise refuse(file, f"tensor {gname} is {kind}, a type quantlab does not dequantize", FIX)
            shape = list(reversed(entry["shape"]))  # ggml's ne is innermost first
            self.source[name], self.types[name] = gname, kind
            if kind in FLOAT_BYTES:
                self.headers[name] = {"dtype": kind, "shape": shape, "file": file.name}
            elif len(shape) == 2 and name != "model.embed_tokens.weight":
                self.headers[name] = {"dtype": "U8", "shape": [shape[0], entry["bytes"] // shape[0]],
                                      "file": file.name}
            else:
                self.dequantize_on_read.add(name)
                self.headers[name] = {"dtype": "F32", "shape": shape, "file": file.name}
            self.where[name] = self
        self._table, self._map = table, None

    def stored_bytes(self, name: str) -> int:
        """Bytes the tensor takes in the file."""
        return self._table[self.source[name]]["bytes"]

    def _raw(self, name: str) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.file, dtype=np.uint8, mode="r")
        entry = self._table[self.source[name]]
        at = self.start + entry["offset"]
        return np.array(self._map[at:at + entry["bytes"]])  # a copy: torch gets writable memory

    def get_tensor(self, name: str):
        """The tensor as the layer classes read it: floats as stored, Linear weights as raw rows of blocks,
        other quantized tensors dequantized; q / k rows un-permuted."""
        import torch

        kind, raw = self.types[name], torch.from_numpy(self._raw(name))
        shape = self.headers[name]["shape"]
        if kind in FLOAT_BYTES:
            value = raw.view(ggml.FLOAT_TYPES[kind]).reshape(shape)
        elif name in self.dequantize_on_read:
            rows = shape[0] if len(shape) == 2 else 1
            value = ggml.dequantize(raw.reshape(rows, -1), kind).reshape(shape)
        else:
            value = raw.reshape(shape)
        heads = self.heads if ".q_proj." in name else self.kv_heads if ".k_proj." in name else 0
        return unpermute(value, heads) if heads else value


def unpermute(rows, heads: int):
    """Undo llama.cpp's q / k row order: within each head, the rows of its two RoPE halves were interleaved."""
    n = rows.shape[0]
    rest = rows.shape[1:]
    return rows.reshape(heads, n // heads // 2, 2, *rest).transpose(1, 2).reshape(n, *rest)


def gguf_file(path: Path) -> Path | None:
    """path itself when it is a .gguf file, the one .gguf file of a directory, else None (several: exit 2)."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise QuantlabError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])})",
                            fix="point engine.checkpoint at one of them")
    return found[0] if found and not (path / "config.json").is_file() else None


def detect(path: Path) -> bool:
    """A .gguf file, or a directory holding exactly one (and no config.json)."""
    return gguf_file(path) is not None


def model_config(meta: dict, tied: bool, has_bias: bool, file: Path) -> dict:
    """config.json of the Llama model the metadata describes."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise refuse(file, f"general.architecture={arch!r}", FIX)
    scaling = sorted(k for k in meta if k.startswith("llama.rope.scaling"))
    if scaling:
        raise refuse(file, f"RoPE scaling ({', '.join(scaling)}), which quantlab does not map", FIX)

    def need(key: str):
        if f"llama.{key}" not in meta:
            raise refuse(file, f"the metadata has no llama.{key}", "re-convert the GGUF file with llama.cpp")
        return meta[f"llama.{key}"]

    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    vocab = meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": int(need("feed_forward_length")), "num_hidden_layers": int(need("block_count")),
              "num_attention_heads": heads,
              "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
              "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
              "max_position_embeddings": int(need("context_length")),
              "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
              "rope_parameters": {"rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
                                  "rope_type": "default"},
              "vocab_size": int(vocab), "tie_word_embeddings": tied, "hidden_act": "silu",
              "attention_bias": has_bias, "mlp_bias": False}
    for key, gkey in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{gkey}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{gkey}"])
    return config


def open_gguf(path: Path) -> Opened:
    """The file parsed, its tensors mapped and typed, its model config derived."""
    file = gguf_file(path)
    meta, table, start = parse(file)
    tensors = GgufTensors(file, meta, table, start)
    tied = "lm_head.weight" not in tensors
    has_bias = any(n.endswith("_proj.bias") for n in tensors.names())
    config = model_config(meta, tied, has_bias, file)
    layers = {name.removesuffix(".weight"): ForeignLayer(f"GGUF_{kind}", ggml.BLOCKS[kind][0],
                                                         bits=int(ggml.bits_of(kind)),
                                                         strategy="block", marker="weight", ggml_type=kind)
              for name, kind in tensors.types.items()
              if tensors.dtype_of(name) == "U8"}
    quant = declared(layers.get, {f.quant_algo for f in layers.values()}, None,
                     {"file_type": meta.get("general.file_type")}, fused_siblings=False)
    counts: dict[str, int] = {}
    for f in layers.values():
        counts[f.ggml_type] = counts.get(f.ggml_type, 0) + 1
    embed = tensors.types.get("model.embed_tokens.weight")
    scheme = ("GGUF " + ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))
              + (f", token embedding {embed}" if embed else "") + ("" if tied else ", separate output head")
              + ", weight-only")

    def transformers_config():
        from transformers import LlamaConfig

        return LlamaConfig(**config)

    return Opened(path, "gguf", "llama.cpp / gguf", scheme, quant, tensors, [file], config,
                  hf_config=transformers_config,
                  dequantized={n: tensors.types[n] for n in tensors.dequantize_on_read})


def metadata(opened: Opened) -> dict:
    """The GGUF metadata as parsed (arrays included: tokenizer.ggml.tokens, merges)."""
    return opened.tensors.meta


PAIRING_KNOBS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
                 "num_attention_heads", "num_key_value_heads")
PAIRING_FIX = "point model.path at the unquantized model the GGUF file was converted from"


def token_mismatch(opened: Opened, tokenizer) -> str | None:
    """How the GGUF file's vocabulary differs from a tokenizer's, id by id (None: identical tokens and special
    ids). The evaluation feeds the reference tokenizer's ids to both models, so they must mean the same tokens."""
    meta = metadata(opened)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        return "the GGUF file carries no tokenizer.ggml.tokens"
    theirs = tokenizer.convert_ids_to_tokens(list(range(len(tokens))))
    if len(tokenizer) != len(tokens):
        return f"{len(tokens)} tokens in the GGUF file, {len(tokenizer)} in the reference tokenizer"
    for i, (a, b) in enumerate(zip(tokens, theirs, strict=True)):
        if a != b:
            return f"token id {i} is {a!r} in the GGUF file and {b!r} in the reference tokenizer"
    return None


def special_token_mismatch(opened: Opened, tokenizer) -> str | None:
    """BOS / EOS ids the GGUF file and the tokenizer disagree on (None: none). The evaluation scores the same ids
    either way; generation would stop on another token."""
    meta = metadata(opened)
    for key, attr in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        ours = meta.get(f"tokenizer.ggml.{key}")
        ref = getattr(tokenizer, attr, None)
        if ours is not None and ref is not None and int(ours) != int(ref):
            return f"{key} is {ours} in the GGUF file and {ref} in the reference tokenizer"
    return None


def pair_with_reference(opened: Opened, ref) -> None:
    """A GGUF file is compared with a reference by its model config, a norm weight (never quantized in GGUF: it
    must equal the reference's up to the file's dtype) and its vocabulary, token by token (exit 2 otherwise)."""
    import torch

    from quantlab.checkpoint import tensor_index
    from quantlab.models import load_tokenizer

    for knob in PAIRING_KNOBS:
        if knob in ref.config and opened.config.get(knob) != ref.config[knob]:
            raise QuantlabError(f"engine.checkpoint {opened.path} was converted from another model: its metadata "
                                f"gives {knob}={opened.config.get(knob)}, the reference {ref.path} has "
                                f"{ref.config[knob]}", fix=PAIRING_FIX)
    index = tensor_index(ref.path)
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):
        if name in index and name in opened.tensors:
            ours, theirs = opened.tensors.get(name), index[name].get_tensor(name)
            if ours.shape != theirs.shape or not torch.equal(ours, theirs.to(ours.dtype)):
                raise QuantlabError(f"engine.checkpoint {opened.path} was converted from another model: {name} "
                                    "(stored unquantized) differs from the reference's", fix=PAIRING_FIX)
            break
    tokenizer = load_tokenizer(ref)
    why = token_mismatch(opened, tokenizer)
    if why:
        raise QuantlabError(f"engine.checkpoint {opened.path} does not share the reference's vocabulary: {why}",
                            fix=PAIRING_FIX + " (the evaluation feeds both the reference tokenizer's ids)")
    special = special_token_mismatch(opened, tokenizer)
    if special:
        import logging

        logging.getLogger("quantlab").warning("GGUF %s: %s (scores are unaffected: both models read the same ids)",
                                              opened.path.name, special)


FORMAT = CheckpointFormat("gguf", "llama.cpp / gguf", detect, open_gguf, pair_with_reference)
