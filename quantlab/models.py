"""The model a run is about (ModelRef) and loading it: the unquantized HF model and its tokenizer.

Only safetensors are read (transformers would prefer a pickle `pytorch_model.bin` lying beside them otherwise), and
every loaded weight is checked to be finite before anything runs on it.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from quantlab.artifacts import fingerprint_files, fingerprint_of
from quantlab.checkpoint import (
    CHECKPOINT_FILES,
    PICKLE_SUFFIXES,
    QUANT_CONFIG,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    read_headers,
    safetensors_files,
)
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
        """The model's maximum positions (from its config; None when it names none)."""
        text = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else self.config
        value = text.get("max_position_embeddings") or text.get("n_positions") or text.get("max_sequence_length")
        return value if isinstance(value, int) and value > 0 else None

    @classmethod
    def from_path(cls, path: str | Path, trust_remote_code: bool = False) -> ModelRef:
        """A local unquantized HF checkpoint, checked without running it (config of a causal LM, not quantized,
        safetensors present with the shapes config.json implies, a tokenizer that loads) and fingerprinted over
        exactly the files loading reads. A failed check is a QuantlabError (exit 2) naming the fix."""
        return _local(path, trust_remote_code)

    def describe(self) -> dict:
        """Name, path, fingerprint, source, model type and architectures, for records."""
        return {"name": self.name, "path": str(self.path), "fingerprint": self.fingerprint, "source": self.source,
                "model_type": self.config.get("model_type"), "architectures": self.config.get("architectures")}


def check_tokenizer(path: Path, trust_remote_code: bool = False):
    """The tokenizer saved beside a model, loaded; exit 2 when it is missing or does not load."""
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
    """The tokenizer of a ModelRef."""
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


# ------------------------------------------------------------------------------------ local checkpoints
def local_name(path: Path) -> str:
    """A local model is named by its directory (the last two parts when the last is a generic word)."""
    generic = {"model", "checkpoint", "hf", "weights", "snapshot", "main", "final", "latest"}
    parts = path.resolve().parts
    name = parts[-1] if parts else str(path)
    if name.lower() in generic and len(parts) > 1:
        name = f"{parts[-2]}/{name}"
    return name


def check_model_dir(path: str | Path) -> Path:
    """model.path as a directory that exists (exit 2 otherwise); file system only, nothing imported."""
    path = Path(path).expanduser()
    if not path.exists():
        raise QuantlabError(f"model.path {path} does not exist",
                            fix="point model.path at a Hugging Face checkpoint directory")
    if not path.is_dir():
        raise QuantlabError(f"model.path {path} is not a directory",
                            fix="point model.path at the directory holding config.json")
    return path


def _local(path: str | Path, trust_remote_code: bool = False) -> ModelRef:
    path = check_model_dir(path)
    config = _read_config(path)
    _check_causal_lm(path, config, trust_remote_code)
    _check_not_quantized(path, config)
    _check_weight_files(path)
    headers = read_headers(path)
    scales = sorted(n for n, h in headers.items() if n.endswith((".weight_scale", ".input_scale", ".weight_scale_2"))
                    or (n.endswith(".weight") and h["dtype"] in ("F8_E4M3", "F8_E5M2", "I8", "U8")))
    if scales:
        raise QuantlabError(f"model.path {path} holds quantized tensors ({', '.join(scales[:3])}): it is already a "
                            "quantized checkpoint and cannot be the unquantized reference",
                            fix="point model.path at the unquantized model, and pass this checkpoint as "
                                "engine.checkpoint= to evaluate it")
    _check_shapes(path, headers, trust_remote_code)
    check_tokenizer(path, trust_remote_code)
    # exactly what loading reads: the safetensors (never a pickle beside them), their index, configs, tokenizer
    loaded = set(safetensors_files(path))
    files = [p for p in path.iterdir() if p.is_file() and (p in loaded or p.name in CHECKPOINT_FILES
                                                          or p.name == SAFE_INDEX)]
    fp = fingerprint_of(fingerprint_files(path, files))
    return ModelRef(local_name(path), path, fp, "path", config, trust_remote_code)


def _check_weight_files(path: Path) -> None:
    """The weights transformers loads, and only those: model.safetensors or the shards an index names. Other
    safetensors names are not loaded (refused with the rename), pickles never; both a model.safetensors and an index
    is ambiguous (transformers loads the first, vLLM and SGLang the files the index names)."""
    found = sorted(p.name for p in path.glob("*.safetensors"))
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    has_index, has_single = (path / SAFE_INDEX).is_file(), (path / SAFE_WEIGHTS).is_file()
    if has_index and has_single:
        raise QuantlabError(f"model.path {path} has both {SAFE_WEIGHTS} and {SAFE_INDEX}: transformers loads the "
                            "first, vLLM and SGLang the shards the index names, so the model is ambiguous",
                            fix="remove whichever is stale (keep the files the model was saved as)")
    if has_index or has_single:
        safetensors_files(path)  # every shard the index names is present
        return
    if found:
        raise QuantlabError(f"model.path {path} holds {', '.join(found[:3])} but no {SAFE_WEIGHTS} or {SAFE_INDEX}, "
                            "so transformers would not load them"
                            + (f" (and {', '.join(pickled)} would never be loaded: pickles are refused)" if pickled
                               else ""),
                            fix=f"rename a single file to {SAFE_WEIGHTS}, or re-save the model with "
                                "save_pretrained(..., safe_serialization=True)")
    hint = f" (found {', '.join(pickled)}: pickle files are never loaded)" if pickled else ""
    raise QuantlabError(f"no *.safetensors weights in {path}{hint}",
                        fix="save the model with save_pretrained(..., safe_serialization=True)")


def _check_not_quantized(path: Path, config: dict) -> None:
    """An exported (quantized) checkpoint is not an unquantized reference: its scales would be dropped."""
    quant = config.get("quantization_config")
    if (path / QUANT_CONFIG).is_file() or quant:
        what = (quant or {}).get("quant_method") or (quant or {}).get("quant_algo") or "quantized"
        raise QuantlabError(f"model.path {path} is already a quantized checkpoint ({what}); it cannot be the "
                            "unquantized reference",
                            fix="point model.path at the unquantized model, and pass this checkpoint as "
                                "engine.checkpoint= to evaluate it")


def _read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise QuantlabError(f"{path} has no config.json, so it is not a Hugging Face checkpoint",
                            fix="point model.path at the directory written by save_pretrained()")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantlabError(f"{cfg_file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise QuantlabError(f"{cfg_file} has no model_type", fix="re-save the model with transformers")
    return config


def _check_causal_lm(path: Path, config: dict, trust_remote_code: bool) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = config.get("architectures") or []
    causal_names = ("ForCausalLM", "LMHeadModel")
    if (config.get("auto_map") and not trust_remote_code
            and config["model_type"] not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        raise QuantlabError(f"{path} needs its own Python code (auto_map in config.json), and remote code is off",
                            fix="review that code, then pass model.trust_remote_code=true")
    if config["model_type"] not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not config.get("auto_map"):
        raise QuantlabError(f"{path} holds a {config['model_type']!r} model, which is not a causal language model",
                            fix="quantlab evaluates decoder LMs (Llama, Qwen2, Mistral, ...); pick such a checkpoint")
    if archs and not any(a.endswith(causal_names) for a in archs):
        raise QuantlabError(f"{path} is a {', '.join(archs)} checkpoint, not a causal LM",
                            fix="use the *ForCausalLM checkpoint of this model family")


def _check_shapes(path: Path, headers: dict[str, dict], trust_remote_code: bool) -> None:
    """Every tensor transformers will load is in the files with the shape config.json implies. The expected names
    come from transformers' own conversion mapping (quantlab.families.disk_names), so renamed and fused weights
    (GPT-NeoX's output head, MoE experts) are checked as they are stored."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantlab.families import disk_names

    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
        expected = disk_names(skeleton)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad config
        raise QuantlabError(f"cannot build the model described by {path}/config.json: {str(exc)[:300]}",
                            fix="check config.json (or re-save the checkpoint with transformers)") from None
    for name, shape in expected.items():
        if name not in headers:
            raise QuantlabError(f"tensor {name} is missing from the safetensors files in {path}",
                                fix="re-save the checkpoint; the files do not match config.json")
        got = tuple(headers[name]["shape"])
        if got != shape:
            raise QuantlabError(f"tensor {name} in {headers[name]['file']} has shape {list(got)}, config.json implies "
                                f"{list(shape)}",
                                fix="the weights and config.json belong to different models; re-save the checkpoint")
