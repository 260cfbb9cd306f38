"""Checkpoint formats quantlab evaluates and audits, recognised from the files alone: FORMATS maps a name to its
CheckpointFormat (detect, open, reference pairing). Opening gives one Opened (quantlab.formats.base): a QuantConfig
whose per-layer formats name QLAYERS classes, and the tensors under Hugging Face module names, so the torch engine
and the audit run every format through the same code.

    modelopt            hf_quant_config.json + safetensors (ModelOpt's export_hf_checkpoint)
    compressed-tensors  config.json quantization_config.quant_method "compressed-tensors" (llm-compressor)
    gptq                quant_method "gptq" / "awq": GPTQModel, AutoGPTQ and AutoAWQ packed int checkpoints
    gguf                a .gguf file (llama.cpp), or a directory holding exactly one

Anything else is exit 2 naming what was found."""
from __future__ import annotations

import json
from pathlib import Path

from quantlab.errors import QuantlabError
from quantlab.formats import compressed_tensors, gguf, gptq, modelopt
from quantlab.formats.base import CheckpointFormat, Opened
from quantlab.registry import Registry

FORMATS: Registry[CheckpointFormat] = Registry("checkpoint format", "engine.checkpoint=DIR")
FORMATS.add("modelopt", modelopt.FORMAT)
FORMATS.add("compressed-tensors", compressed_tensors.FORMAT)
FORMATS.add("gptq", gptq.FORMAT)
FORMATS.add("gguf", gguf.FORMAT)

__all__ = ["FORMATS", "Opened", "detect", "open_checkpoint"]


def detect(path: str | Path) -> CheckpointFormat:
    """The format of the checkpoint at path, from its files; exit 2 naming what was found when none matches."""
    path = Path(path).expanduser()
    if not path.exists():
        raise QuantlabError(f"checkpoint {path} does not exist",
                            fix="pass the directory (or GGUF file) of a quantized checkpoint")
    for entry in FORMATS.values():
        if entry.detect(path):
            return entry
    raise QuantlabError(f"checkpoint {path} is in no format quantlab reads: {_found(path)}",
                        fix="quantlab reads ModelOpt exports (hf_quant_config.json), compressed-tensors "
                            "(llm-compressor save_compressed), GPTQ / AWQ packed checkpoints (GPTQModel, AutoGPTQ, "
                            "AutoAWQ) and GGUF files; point at one of those")


def open_checkpoint(path: str | Path) -> Opened:
    """The checkpoint at path opened by its format (QuantlabError, exit 2, for an unknown or unsupported layout)."""
    return detect(path).open(Path(path).expanduser())


def _found(path: Path) -> str:
    """What is there, for the error message: the quantization_config's quant_method, or the files."""
    if path.is_file():
        return f"a file with suffix {path.suffix or '(none)'} (not .gguf)"
    config = path / "config.json"
    if config.is_file():
        try:
            doc = json.loads(config.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            doc = None
        qc = doc.get("quantization_config") if isinstance(doc, dict) else None
        if isinstance(qc, dict):
            return (f"config.json declares quantization_config.quant_method={qc.get('quant_method')!r}, and it has "
                    "no hf_quant_config.json")
        if isinstance(doc, dict):
            return ("config.json declares no quantization_config and there is no hf_quant_config.json (an "
                    "unquantized model?)")
    names = sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else []
    return f"no hf_quant_config.json, no config.json, no .gguf file (it holds {', '.join(names) or 'nothing'})"
