"""The model a run is about (ModelRef) and loading it: the unquantized HF model and its tokenizer.

Only safetensors are read (transformers would prefer a pickle `pytorch_model.bin` lying beside them otherwise), and
every loaded weight is checked to be finite before anything runs on it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from quantlab.checkpoint import read_headers
from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")


@dataclass
class ModelRef:
    """A resolved model: a local HF checkpoint directory and the fingerprint of exactly the files loaded from it."""

    name: str
    path: Path
    fingerprint: str
    source: str  # embedded | path
    config: dict = field(repr=False)
    trust_remote_code: bool = False
    family: str | None = None  # quantlab.families entry (None: unverified)

    @cached_property
    def num_params(self) -> int:
        """Parameters in the checkpoint, from the safetensors headers (no tensor is read)."""
        return sum(math.prod(meta["shape"]) for meta in read_headers(self.path).values())

    @property
    def vocab_size(self) -> int | None:
        """Rows of the input embedding (token ids at or above it cannot be looked up)."""
        text = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else self.config
        value = text.get("vocab_size")
        return value if isinstance(value, int) and value > 0 else None

    @property
    def max_positions(self) -> int | None:
        text = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else self.config
        value = text.get("max_position_embeddings") or text.get("n_positions") or text.get("max_sequence_length")
        return value if isinstance(value, int) and value > 0 else None

    def describe(self) -> dict:
        return {"name": self.name, "path": str(self.path), "fingerprint": self.fingerprint, "source": self.source,
                "model_type": self.config.get("model_type"), "architectures": self.config.get("architectures")}


def check_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise QuantlabError(f"{path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)",
                            fix="save the tokenizer beside the model: tokenizer.save_pretrained(dir)")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise QuantlabError(f"the tokenizer in {path} does not load: {str(exc)[:300]}",
                            fix="re-save the tokenizer with tokenizer.save_pretrained(dir)") from None


def load_tokenizer(ref: ModelRef):
    return check_tokenizer(ref.path, ref.trust_remote_code)


def attn_implementation(config: dict) -> str | None:
    """The attention implementation a family must run with to compute what it defines (Gemma 2's soft-capping is
    ignored by sdpa, so it loads with eager)."""
    from quantlab.families import FAMILIES

    family = FAMILIES.find(lambda f: f.name == config.get("model_type"))
    return family.attn_implementation if family else None


def check_finite(model, what: str) -> None:
    """A NaN or Inf weight makes every metric meaningless: refuse it by name before any forward pass."""
    import torch

    for name, param in model.named_parameters():
        if param.is_floating_point() and not torch.isfinite(param).all():
            bad = int((~torch.isfinite(param)).sum())
            raise QuantlabError(f"{what} has {bad} NaN/Inf value(s) in weight {name}",
                                fix="the checkpoint is damaged: re-download or re-save it")


def load_model(ref: ModelRef, device, dtype, device_map: str | None = None):
    """The unquantized HF model in eval mode, on device (from safetensors only)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "trust_remote_code": ref.trust_remote_code, "use_safetensors": True}
    implementation = attn_implementation(ref.config)
    if implementation:
        kwargs["attn_implementation"] = implementation
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(ref.path, **kwargs)
    if not model.config.architectures:
        model.config.architectures = [type(model).__name__]
    if not device_map:
        model.to(device.torch)
    else:
        placed = sorted({str(d) for d in getattr(model, "hf_device_map", {}).values()})
        log.info("model.device_map=%s placed the model on: %s", device_map, ", ".join(placed))
    check_finite(model, f"model {ref.name}")
    return model.eval()


def skeleton(ref: ModelRef):
    """The model built from its config on the meta device: structure without memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(ref.path, trust_remote_code=ref.trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=ref.trust_remote_code)


def quantized_in_dims(ref: ModelRef) -> dict[str, int]:
    """Input width of every Linear that gets quantized (the output head stays in high precision), by short layer
    name (q_proj, down_proj, ...): what an AWQ block size must divide."""
    import torch

    model = skeleton(ref)
    head = model.get_output_embeddings()
    dims: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            dims.setdefault(name.split(".")[-1], module.in_features)
    return dims
