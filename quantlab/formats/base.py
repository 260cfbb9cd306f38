"""What every checkpoint format gives the engine and the audit once it is opened: one QuantConfig (per-layer
formats keyed by QLAYERS names), lazy tensors under Hugging Face module names, the model's config, the files that
make the checkpoint (its identity and size on disk) and the facts a report needs (tool, scheme, bits per weight).

A leaf module: it imports quantlab.checkpoint and quantlab.errors only."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from quantlab.checkpoint import DTYPE_BYTES, CheckpointTensors, LayerFormat, QuantConfig
from quantlab.errors import QuantlabError


@dataclass(frozen=True)
class ForeignLayer(LayerFormat):
    """One layer of a checkpoint made by another tool. quant_algo names its QLAYERS class (CT_PACKED_INT4,
    GPTQ_INT4, GGUF_Q4_K, ...); the other fields say how that tool stored it.

    bits: width of the stored codes; symmetric: no zero points (or the format's fixed mid-range zero);
    strategy: what one weight scale covers (tensor, channel, group, block); block: [rows, cols] of a block scale;
    activations: None (weight-only), "dynamic_token" (a scale per token computed at run time) or "static_tensor"
    (input_scale from the checkpoint); act_type: "int" or "float" (FP8 E4M3) activations; act_bits: their width;
    zero_offset: added to stored zero points (GPTQ v1 stores z - 1); marker: the tensor suffix whose presence says
    the layer is stored quantized; ggml_type: the GGUF type name."""

    bits: int = 8
    symmetric: bool = True
    strategy: str = "channel"
    block: tuple[int, int] | None = None
    activations: str | None = None
    act_type: str = "int"
    act_bits: int = 8
    zero_offset: int = 0
    marker: str = "weight_scale"
    ggml_type: str = ""


@dataclass
class DeclaredQuantConfig(QuantConfig):
    """A QuantConfig whose per-layer formats follow another tool's rules (compressed-tensors' targets and ignore
    lists, GPTQ's per-layer tensors, GGUF's per-tensor types) instead of hf_quant_config.json's lists: `resolve`
    answers for any module name, `declared_algos` are every format the checkpoint can hold."""

    resolve: Callable[[str], LayerFormat | None] | None = field(default=None, repr=False)
    declared_algos: frozenset = frozenset()
    fused_siblings: bool = True  # engines of this format fuse q/k/v and gate/up (vLLM does; llama.cpp does not)

    @property
    def mixed(self) -> bool:
        """More than one format declared where engines fuse siblings (the audit then checks they share one)."""
        return self.fused_siblings and len(self.declared_algos) > 1

    def format_of(self, module: str) -> LayerFormat | None:
        """The format the tool's declaration gives this module (None: left unquantized)."""
        return self.resolve(module) if self.resolve is not None else None

    def algos(self) -> set[str]:
        """Every format the checkpoint declares."""
        return set(self.declared_algos)


def declared(resolve: Callable[[str], LayerFormat | None], algos: set[str], kv: str | None, raw: dict,
             group_size: int | None = None, fused_siblings: bool = True) -> DeclaredQuantConfig:
    """A DeclaredQuantConfig labelled with its formats joined by '+' (one format: its name)."""
    label = "+".join(sorted(algos)) or None
    return DeclaredQuantConfig(label, kv, group_size, [], {}, raw, resolve=resolve, declared_algos=frozenset(algos),
                               fused_siblings=fused_siblings)


@dataclass
class Opened:
    """A checkpoint opened by its format (quantlab.formats.FORMATS).

    path: what was given (a directory, or a GGUF file); format: the FORMATS name; tool: who writes this format;
    scheme: one line saying what it holds; quant: the declared per-layer formats; tensors: every tensor under the
    model's checkpoint names; files: the files it is made of; config: config.json's content (derived from the
    metadata when the format has none); hf_config: a transformers config to build the model from when there is no
    config.json; kv_names: where the KV cache scales of an attention module are ("<attention>.<k>", "<attention>.<v>");
    dequantized: tensors stored quantized that are not Linear weights (GGUF's token embedding), handed out
    dequantized, name -> stored type; notes: declarations quantlab read but does not apply (said in reports)."""

    path: Path
    format: str
    tool: str
    scheme: str
    quant: QuantConfig
    tensors: CheckpointTensors
    files: list[Path]
    config: dict
    hf_config: Any = None
    kv_names: tuple[str, str] = ("k_proj.k_scale", "v_proj.v_scale")
    dequantized: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def transformers_config(self):
        """The transformers config to build the model from: None when the checkpoint has a config.json (read it
        from the directory), else built from `config` (a GGUF file's metadata)."""
        if self.hf_config is None:
            return None
        return self.hf_config()

    @property
    def directory(self) -> Path:
        """The directory holding the checkpoint (the file's for a single-file format)."""
        return self.path if self.path.is_dir() else self.path.parent

    def size_bytes(self) -> int:
        """Bytes on disk of the weight files (safetensors shards or the GGUF file)."""
        return sum(f.stat().st_size for f in self.files)

    def marker_of(self, module: str) -> str | None:
        """The tensor suffix that says `module` is stored quantized in this format (None: declared unquantized)."""
        fmt = self.quant.format_of(module)
        if fmt is None:
            return None
        return fmt.marker if isinstance(fmt, ForeignLayer) else "weight_scale"

    def weight_bits(self, linears: dict[str, tuple[int, int, bool]]) -> dict:
        """Bits per weight of the quantized Linear layers: every stored tensor of each quantized layer (codes,
        scales, zero points, act-order indices; biases excluded) over the number of weights it represents; also
        the number of such layers and of their weights. `linears`: module -> (out, in, has_bias)."""
        stored_bits, weights, layers = 0, 0, 0
        names_by_module: dict[str, list[str]] = {}
        for name in self.tensors.names():
            names_by_module.setdefault(name.rpartition(".")[0], []).append(name)
        for module, (out_f, in_f, _bias) in linears.items():
            marker = self.marker_of(module)
            if marker is None or f"{module}.{marker}" not in self.tensors:
                continue
            layers += 1
            weights += out_f * in_f
            for name in names_by_module.get(module, []):
                if name.endswith(".bias"):
                    continue
                stored_bits += 8 * tensor_bytes(self.tensors, name)
        return {"bits_per_weight": round(stored_bits / weights, 4) if weights else None,
                "quantized_layers": layers, "quantized_weights": weights}


def tensor_bytes(t: CheckpointTensors, name: str) -> int:
    """Bytes a tensor takes in its file, from its header (GGUF views report their stored bytes)."""
    stored = getattr(t, "stored_bytes", None)
    if stored is not None:
        return stored(name)
    entry = t.headers[name]
    count = 1
    for d in entry["shape"]:
        count *= d
    return count * DTYPE_BYTES[entry["dtype"]]


@dataclass(frozen=True)
class CheckpointFormat:
    """A checkpoint format quantlab reads: `detect(path)` says from the files alone (cheaply, nothing heavy
    imported) whether path is one; `open(path)` reads its declarations and tensors (QuantlabError naming what is
    unsupported); `pairing(opened, ref)` refuses a reference model the checkpoint was not made from."""

    name: str
    tool: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], Opened]
    pairing: Callable[[Opened, Any], None] | None = None


def refuse(path: Path, what: str, fix: str) -> QuantlabError:
    """The error for a layout quantlab recognises but does not run: what was found, and the way out."""
    return QuantlabError(f"checkpoint {path}: {what}", fix=fix)
