"""What config.json implies (Layout: every tensor on disk, the Linear-like modules, embeddings, attention and the
output head, built on the meta device) and how one quantized layer is read (_Probe records the first tensor a
format refuses)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantlab.checkpoint import CheckpointTensors
from quantlab.errors import QuantlabError


def block_of(module: str) -> str:
    """The decoder block a module belongs to (the prefix up to its last numeric part), "" at the top level."""
    parts = module.split(".")
    numeric = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[: numeric[0] + 1]) if numeric else ""


def _torch_dtype(name: str):
    import torch

    return {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8, "U8": torch.uint8,
            "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
            "I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "BOOL": torch.bool}.get(name)


class _Probe(CheckpointTensors):
    """The checkpoint as one QLAYERS class reads it to build one layer: the first tensor it refuses (missing, or of
    another dtype or shape than its format implies) is recorded with what was expected, so a refusal is reported
    by kind and tensor without parsing messages."""

    def __init__(self, base: CheckpointTensors):  # shares base's validated headers and open files
        self.ckpt, self.headers, self.where = base.ckpt, base.headers, base.where
        self.refusal: tuple | None = None  # (kind, tensor, found, expected)

    def get(self, name: str, dtype=None, shape: tuple | None = None):
        if self.refusal is None:
            if name not in self.where:
                self.refusal = ("missing", name, None, None)
            elif dtype is not None and _torch_dtype(self.dtype_of(name)) != dtype:
                self.refusal = ("dtype", name, self.dtype_of(name), str(dtype).removeprefix("torch."))
            elif shape is not None and self.shape_of(name) != tuple(shape):
                self.refusal = ("shape", name, list(self.shape_of(name)), list(shape))
        return super().get(name, dtype, shape)


@dataclass
class Layout:
    """What config.json implies: every tensor on disk (hub names, tied copies removed) with its shape, the
    Linear-like modules (disk names -> out, in, has bias), embeddings, attention modules and the output head."""

    expected: dict[str, tuple]
    linears: dict[str, tuple[int, int, bool]]
    embeddings: set[str]
    attention: list[str]
    head: str | None
    tie_word_embeddings: bool


def _layout(ckpt: Path, hf_config=None) -> Layout:
    """Built on the meta device from the export's config.json, or the transformers config given (a GGUF file's,
    quantlab.formats), with no memory (~0.1 s)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = hf_config if hf_config is not None else AutoConfig.from_pretrained(ckpt)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the structure, not transformers' view of the quantization
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for configs it cannot build
        raise QuantlabError(f"cannot build the model that {ckpt}/config.json describes: {str(exc)[:300]}",
                            fix="the audit builds the architecture with transformers from config.json; export "
                                "with export_hf_checkpoint() from a transformers model") from None
    memory = model.state_dict()
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        disk = revert_weight_conversion(model, remove_tied_weights_from_state_dict(memory, model))
    except Exception:  # noqa: BLE001 - older transformers: memory names are disk names
        disk = {k: v for k, v in memory.items() if k not in tied}
    expected = {k: tuple(v.shape) for k, v in disk.items()}
    modules = dict(model.named_modules())
    embeddings = {n for n, m in modules.items() if isinstance(m, torch.nn.Embedding)}
    head_module = model.get_output_embeddings()
    head = next((n for n, m in modules.items() if m is head_module), None)
    if head is not None and f"{head}.weight" not in expected:
        try:  # NeoX: lm_head in memory, embed_out on disk
            renamed = list(revert_weight_conversion(model, {f"{head}.weight": head_module.weight}))
            head = renamed[0][: -len(".weight")] if renamed else head
        except Exception:  # noqa: BLE001
            pass
    linears = {}
    for name, shape in expected.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        mod = name[: -len(".weight")]
        found = modules.get(mod)
        if mod in embeddings or (found is not None and not isinstance(found, torch.nn.Linear)):
            continue  # embeddings, routers (not nn.Linear: never quantized), convolutions
        out_f, in_f = (found.out_features, found.in_features) if found is not None else shape
        linears[mod] = (out_f, in_f, f"{mod}.bias" in expected)
    attention = sorted(n for n, m in modules.items() if type(m).__name__.endswith("Attention"))
    return Layout(expected, linears, embeddings, attention, head, bool(getattr(config, "tie_word_embeddings", False)))
