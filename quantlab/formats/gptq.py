"""GPTQ and AWQ packed int checkpoints as GPTQModel, AutoGPTQ and AutoAWQ save them: config.json's
quantization_config (or quantize_config.json) with quant_method "gptq" or "awq", and per quantized Linear the tensors
qweight / qzeros / scales (/ g_idx).

The packing follows the format field, not quant_method (GPTQModel labels its AWQ-layout export quant_method "gptq"
with format "gemm"):

    gptq      (v1)  qweight [in*b/32, out] along the input dimension, qzeros [groups, out*b/32] storing z - 1
    gptq_v2         as gptq, qzeros storing z
    gemm      (AWQ) qweight [in, out/8] and qzeros [groups, out/8], nibbles interleaved 0,2,4,6,1,3,5,7, z as is

Refused by name: other formats (marlin, bitblas, gemv, exllama, ipex, qqq ...), 3-bit codes, pack dtypes other than
int32, per-module overrides (GPTQModel's `dynamic` with other bits or group sizes), AWQ without zero points."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from quantlab.checkpoint import CheckpointTensors, read_json_file, safetensors_files
from quantlab.formats.base import CheckpointFormat, ForeignLayer, Opened, declared, refuse

METHODS = ("gptq", "awq")
LAYOUTS = {"gptq": ("GPTQ", 1), "gptq_v2": ("GPTQ", 0), "gemm": ("AWQ_GEMM", 0)}  # format -> (family, zero offset)
FIX = ("quantlab reads GPTQ (format gptq / gptq_v2) and AWQ GEMM packed checkpoints; convert or re-save in one of "
       "those layouts (GPTQModel: format='gptq' or 'gemm')")


def declaration(path: Path) -> dict | None:
    """The GPTQ / AWQ quantization config: config.json's quantization_config when its quant_method is gptq or awq,
    else quantize_config.json (AutoGPTQ), else None."""
    if not path.is_dir():
        return None
    for name, key in (("config.json", "quantization_config"), ("quantize_config.json", None)):
        file = path / name
        if not file.is_file():
            continue
        try:
            doc = json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue
        qc = doc.get(key) if key and isinstance(doc, dict) else doc
        if isinstance(qc, dict) and (qc.get("quant_method") in METHODS or (key is None and "bits" in qc)):
            return qc
    return None


def detect(path: Path) -> bool:
    """A directory whose quantization config says gptq or awq."""
    return declaration(path) is not None


def _layout(path: Path, qc: dict) -> str:
    method = qc.get("quant_method", "gptq")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse(path, f"AWQ version {version!r}: its packing differs from the GEMM layout", FIX)
        if qc.get("zero_point") is False:
            raise refuse(path, "AWQ without zero points (zero_point=false)", FIX)
        return "gemm"
    fmt = qc.get("checkpoint_format") or qc.get("format") or ("marlin" if qc.get("is_marlin_format") else "gptq")
    if fmt not in LAYOUTS:
        raise refuse(path, f"quant_method {method!r} with format {fmt!r}", FIX)
    return fmt


def _checked(path: Path, qc: dict) -> tuple[int, int]:
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if bits not in (2, 4, 8):
        raise refuse(path, f"{bits}-bit codes (quantlab unpacks 2-, 4- and 8-bit fields that tile an int32)", FIX)
    if not (type(group) is int and group > 0):
        raise refuse(path, f"group_size={group!r}: per-channel GPTQ (group_size -1) or a malformed size",
                     "quantlab reads group-wise GPTQ / AWQ; re-quantize with a positive group_size")
    if qc.get("pack_dtype", "int32") != "int32":
        raise refuse(path, f"pack_dtype={qc.get('pack_dtype')!r} (quantlab reads int32 words)", FIX)
    return bits, group


def _skips(path: Path, qc: dict) -> list[str]:
    """GPTQModel's dynamic rules that skip modules ("-:regex"); any other override is refused."""
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise refuse(path, "dynamic is not an object of module patterns", FIX)
    skips = []
    for pattern, override in dynamic.items():
        if pattern.startswith("-:"):
            skips.append(pattern[2:])
        elif override:
            raise refuse(path, f"dynamic[{pattern!r}] = {json.dumps(override)[:120]}: per-module bits or group "
                         "sizes", "quantlab reads one bits / group_size per checkpoint; re-quantize without "
                         "per-module overrides")
    return skips


def open_gptq(path: Path) -> Opened:
    """The declaration checked; each Linear holding qweight is a layer of the declared layout."""
    qc = declaration(path) or {}
    layout = _layout(path, qc)
    bits, group = _checked(path, qc)
    family, offset = LAYOUTS[layout]
    if family == "AWQ_GEMM" and bits != 4:
        raise refuse(path, f"AWQ GEMM with {bits}-bit codes (its interleave is defined for 4 bits)", FIX)
    symmetric = bool(qc.get("sym", family == "GPTQ" and not qc.get("zero_point", False)))
    algo = f"{family}_INT{bits}"
    layer = ForeignLayer(algo, group, bits=bits, symmetric=symmetric, strategy="group", zero_offset=offset,
                         marker="qweight")
    skips = _skips(path, qc)
    keep = list(qc.get("modules_to_not_convert") or [])
    lm_head = bool(qc.get("lm_head", False))
    tensors = CheckpointTensors(path)

    @functools.cache
    def resolve(module: str):
        leaf = module.rpartition(".")[2]
        if (leaf == "lm_head" and not lm_head) or any(re.match(p, module) for p in skips) \
                or any(k == module or k == leaf or module.endswith("." + k) for k in keep):
            return None
        return layer if f"{module}.qweight" in tensors else None

    quant = declared(resolve, {algo}, None, qc, group)
    tool = ", ".join((qc.get("meta") or {}).get("quantizer") or []) or {"awq": "AutoAWQ"}.get(
        qc.get("quant_method"), "AutoGPTQ")
    order = ", act-order (desc_act)" if qc.get("desc_act") else ""
    scheme = (f"{'GPTQ' if family == 'GPTQ' else 'AWQ GEMM'} int{bits} group {group}, "
              f"{'symmetric' if symmetric else 'asymmetric'}{order}, format {layout}, weight-only")
    config = read_json_file(path / "config.json", "config") if (path / "config.json").is_file() else {}
    return Opened(path, "gptq", tool, scheme, quant, tensors, safetensors_files(path), config)


FORMAT = CheckpointFormat("gptq", "GPTQModel / AutoGPTQ / AutoAWQ", detect, open_gptq)
