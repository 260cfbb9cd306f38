"""Reading checkpoints on disk: safetensors headers (validated before any tensor is read), lazy tensor access with
errors that name the tensor, and hf_quant_config.json parsed into one shape for uniform and mixed exports.

A leaf module: it imports nothing of quantlab but errors, so engines, stages, the audit and reports share it.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantlab.errors import QuantlabError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "merges.txt",
                   "special_tokens_map.json", "chat_template.jinja", "added_tokens.json")
CHECKPOINT_FILES = ("config.json", "generation_config.json") + TOKENIZER_FILES
QUANT_CONFIG = "hf_quant_config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

# bytes per element of every safetensors dtype
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "C64": 8, "U64": 8, "U32": 4, "U16": 2}
MAX_HEADER = 100_000_000
QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I8", "U8")  # quantized codes
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def _bad(file: Path, why: str) -> QuantlabError:
    return QuantlabError(f"{file.name} is not a readable safetensors file ({why})",
                         fix="re-download or re-save the checkpoint (save_pretrained(..., safe_serialization=True))")


def read_safetensors_header(file: Path) -> dict[str, dict]:
    """name -> {dtype, shape, data_offsets}, checked against the file: sizes, offsets inside the data section and
    not overlapping, dtype known, shape made of non-negative integers. Hostile or damaged headers are refused by
    name before any tensor is read (nothing here allocates more than the header's own bytes)."""
    file = Path(file)
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise _bad(file, "shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw_len)
            if n > size - 8 or n > MAX_HEADER:
                raise _bad(file, "header length beyond the end of the file")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _bad(file, f"header is not JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict):
        raise _bad(file, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad(file, "__metadata__ must map strings to strings")
    data_size = size - 8 - n
    spans = [_checked_entry(file, name, entry, data_size, size - data_size) for name, entry in header.items()]
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise _bad(file, f"tensors {a[:60]!r} and {b[:60]!r} overlap")
    end = spans[-1][1] if spans else 0
    if end != data_size:
        raise QuantlabError(f"{file.name} is truncated or corrupt: its header describes {8 + n + end} bytes, "
                            f"the file has {size}", fix="re-download or re-save the checkpoint")
    return header


def _checked_entry(file: Path, name: str, entry, data_size: int, data_start: int) -> tuple[int, int, str]:
    """One header entry, checked: its keys, a known dtype, a shape of non-negative integers, offsets that match
    shape and dtype and end inside the data section; its (start, end, name)."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _bad(file, f"entry {name[:80]!r} is not {{dtype, shape, data_offsets}}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise _bad(file, f"tensor {name[:80]!r} has unknown dtype {str(dtype)[:20]!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _bad(file, f"tensor {name[:80]!r} has a malformed shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _bad(file, f"tensor {name[:80]!r} has malformed data_offsets")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise _bad(file, f"tensor {name[:80]!r}: its byte range does not match its shape and dtype")
    if offsets[1] > data_size:
        raise QuantlabError(f"{file.name} is truncated or corrupt: tensor {name} ends at byte "
                            f"{data_start + offsets[1]}, the file has {data_start + data_size}",
                            fix="re-download or re-save the checkpoint")
    return offsets[0], offsets[1], name


def read_json_file(file: Path, what: str, fix: str = "re-export or re-save the checkpoint; the file is damaged"):
    """The JSON document in file (any type; the caller checks its shape); a file that is not UTF-8 JSON is a
    QuantlabError naming it, with the fix."""
    try:
        return json.loads(Path(file).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise QuantlabError(f"{what} {file} is not valid JSON ({str(exc)[:120]})", fix=fix) from None


SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"


def safetensors_index(directory: Path) -> dict[str, str] | None:
    """model.safetensors.index.json's weight_map (tensor name -> file), or None when there is no index. A damaged
    index is a QuantlabError naming it."""
    file = Path(directory) / SAFE_INDEX
    if not file.is_file():
        return None
    doc = read_json_file(file, "the index", fix="re-save the checkpoint; its index is damaged")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not (isinstance(weight_map, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in weight_map.items())):
        raise QuantlabError(f"{file} has no weight_map of tensor names to file names",
                            fix="re-save the checkpoint; its index is damaged")
    return weight_map


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files a serving engine loads from a directory: the shards model.safetensors.index.json names
    (vLLM's and SGLang's rule) when there is an index, else model.safetensors, else every *.safetensors file (an
    export under other names). A shard the index names but the directory lacks is a QuantlabError."""
    directory = Path(directory)
    weight_map = safetensors_index(directory)
    if weight_map is not None:
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (directory / n).is_file() or "/" in n or n.startswith(".")]
        if missing:
            raise QuantlabError(f"{directory / SAFE_INDEX} names {', '.join(missing[:3])}, which "
                                f"{'is' if len(missing) == 1 else 'are'} not in {directory}",
                                fix="copy every shard the index names, or re-save the checkpoint")
        return [directory / n for n in names]
    if (directory / SAFE_WEIGHTS).is_file():
        return [directory / SAFE_WEIGHTS]
    return sorted(directory.glob("*.safetensors"))


def read_headers(directory: Path, files: list[Path] | None = None, first_wins: bool = False) -> dict[str, dict]:
    """Every tensor's header entry over the safetensors files a loader reads (safetensors_files, or the files
    given), with its file name added. A tensor in two of them is a QuantlabError, unless first_wins (the audit
    reads such a directory as it is and reports the repeats)."""
    out: dict[str, dict] = {}
    for file in safetensors_files(directory) if files is None else files:
        for name, entry in read_safetensors_header(file).items():
            if name in out and first_wins:
                continue
            if name in out:
                raise QuantlabError(f"tensor {name} appears in both {out[name]['file']} and {file.name}",
                                    fix="re-save the checkpoint; its shards overlap")
            out[name] = {**entry, "file": file.name}
    return out


def tensor_index(directory: Path, files: list[Path] | None = None) -> dict[str, Any]:
    """Tensor name -> open safetensors handle, over the safetensors files a loader reads (safetensors_files, or the
    files given; nothing loaded)."""
    from safetensors import safe_open

    index = {}
    for f in safetensors_files(directory) if files is None else files:
        handle = safe_open(str(f), "pt")
        index.update({name: handle for name in handle.keys() if name not in index})  # the first file's copy
    return index


class CheckpointTensors:
    """Lazy access to every tensor of a checkpoint, with errors that name the tensor. Headers are validated first.
    `files`: the safetensors files to read (default: those a serving engine loads, safetensors_files); a tensor in
    two of them is refused, or with first_wins read from the first."""

    def __init__(self, ckpt: Path, files: list[Path] | None = None, first_wins: bool = False):
        self.ckpt = Path(ckpt)
        files = safetensors_files(self.ckpt) if files is None else list(files)
        if not files:
            raise QuantlabError(f"checkpoint {self.ckpt} has no safetensors files",
                                fix="point at the directory export_hf_checkpoint() or save_pretrained() wrote")
        self.files = files
        self.headers = read_headers(self.ckpt, files, first_wins)
        self.where = tensor_index(self.ckpt, files)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint."""
        return list(self.where)

    def dtype_of(self, name: str) -> str | None:
        """The safetensors dtype string (F8_E4M3, I8, U8, BF16, ...) without reading the tensor."""
        entry = self.headers.get(name)
        return entry["dtype"] if entry else None

    def shape_of(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape from its header, without reading it; None when there is no such tensor."""
        entry = self.headers.get(name)
        return tuple(entry["shape"]) if entry else None

    def get(self, name: str, dtype=None, shape: tuple | None = None):
        """Read one tensor. A missing tensor, or one of another dtype or shape than those given, is a
        QuantlabError (exit 2) that names it."""
        if name not in self.where:
            raise QuantlabError(f"exported checkpoint {self.ckpt} is missing tensor {name}",
                                fix="re-export the checkpoint (delete its cache entry or rerun quantization)")
        t = self.where[name].get_tensor(name)
        if dtype is not None and t.dtype != dtype:
            raise QuantlabError(f"tensor {name} in {self.ckpt} has dtype {t.dtype}, expected {dtype}",
                                fix="re-export the checkpoint; it was not written by this quantization recipe")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise QuantlabError(f"tensor {name} in {self.ckpt} has shape {list(t.shape)}, expected {list(shape)}",
                                fix="re-export the checkpoint; scales and weights do not match")
        return t

    def optional(self, name: str, dtype=None, shape: tuple | None = None):
        """get() for a tensor the checkpoint may lack: None when absent, checked like get() when present."""
        return self.get(name, dtype, shape) if name in self else None


# ------------------------------------------------------------------------------------------ quant config
@dataclass(frozen=True)
class LayerFormat:
    """One layer's declared format: its quant_algo and, for group-wise formats, the group size."""

    quant_algo: str
    group_size: int | None = None


@dataclass
class QuantConfig:
    """hf_quant_config.json in one shape: `layers` maps a module name to its format for mixed-precision exports
    (quant_algo MIXED_PRECISION); for a uniform export it is empty and `quant_algo` applies to every quantized
    Linear outside `exclude_modules`."""

    quant_algo: str | None
    kv_cache_quant_algo: str | None = None
    group_size: int | None = None
    exclude_modules: list[str] = field(default_factory=list)
    layers: dict[str, LayerFormat] = field(default_factory=dict)
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def mixed(self) -> bool:
        """True for a mixed-precision export (per-layer formats in `layers`)."""
        return bool(self.layers)

    def format_of(self, module: str) -> LayerFormat | None:
        """The format of one module as the export declares it (None: left unquantized)."""
        if self.layers:
            return self.layers.get(module)
        if self.quant_algo is None or is_excluded(module, self.exclude_modules):
            return None
        return LayerFormat(self.quant_algo, self.group_size)

    def algos(self) -> set[str]:
        """Every quant_algo the export declares (each layer's for a mixed export); empty when none."""
        return {f.quant_algo for f in self.layers.values()} if self.layers else ({self.quant_algo} - {None})


def is_excluded(module: str, patterns: list[str]) -> bool:
    """exclude_modules entries are module names or fnmatch patterns ("lm_head", "*.mlp.gate")."""
    from fnmatch import fnmatchcase

    return any(module == p or fnmatchcase(module, p) for p in patterns)


def _int_or_none(value, where: str, file: Path) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value <= 0:
        raise QuantlabError(f"{file} has {where}={value!r}, not a positive integer",
                            fix="re-export the checkpoint; its hf_quant_config.json is damaged")
    return value


def read_quant_config(ckpt: Path, required: bool = False) -> QuantConfig | None:
    """The checkpoint's quantization as declared by hf_quant_config.json; None when there is none (unless required).
    A malformed file is a QuantlabError naming the field, never a KeyError."""
    file = Path(ckpt) / QUANT_CONFIG
    if not file.is_file():
        if required:
            raise QuantlabError(f"{ckpt} has no {QUANT_CONFIG}, so it is not a ModelOpt export",
                                fix="point at the directory export_hf_checkpoint() wrote")
        return None
    doc = read_json_file(file, "the quantization config",
                         fix="re-export the checkpoint; its hf_quant_config.json is damaged")
    quant = doc.get("quantization") if isinstance(doc, dict) else None
    if not isinstance(quant, dict):
        raise QuantlabError(f"{file} has no 'quantization' object", fix="re-export the checkpoint")
    algo, kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    for key, value in (("quant_algo", algo), ("kv_cache_quant_algo", kv)):
        if value is not None and not isinstance(value, str):
            raise QuantlabError(f"{file} has {key}={value!r}, not a string", fix="re-export the checkpoint")
    exclude = quant.get("exclude_modules") or []
    if not (isinstance(exclude, list) and all(isinstance(x, str) for x in exclude)):
        raise QuantlabError(f"{file} has a malformed exclude_modules (a list of module names expected)",
                            fix="re-export the checkpoint")
    layers: dict[str, LayerFormat] = {}
    per_layer = quant.get("quantized_layers")
    if per_layer is not None:
        if not isinstance(per_layer, dict):
            raise QuantlabError(f"{file} has a malformed quantized_layers (an object expected)",
                                fix="re-export the checkpoint")
        for name, entry in per_layer.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("quant_algo"), str)):
                raise QuantlabError(f"{file}: quantized_layers[{name!r}] has no quant_algo string",
                                    fix="re-export the checkpoint")
            layers[name] = LayerFormat(entry["quant_algo"],
                                       _int_or_none(entry.get("group_size"), f"{name}.group_size", file))
    group = _int_or_none(quant.get("group_size"), "group_size", file)
    return QuantConfig(algo, kv, group, list(exclude), layers, doc)
