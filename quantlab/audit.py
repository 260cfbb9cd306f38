"""Silent-failure audit of an exported checkpoint, in seconds on a CPU, before any evaluation runs on it.

    python -m quantlab.audit CHECKPOINT [--reference MODEL_DIR] [--no-canary] [--json OUT]

    from quantlab.audit import audit
    report = audit("/exports/fp8", reference="/models/llama")   # an AuditReport; report.errors, report.to_dict()

It reads a unified HF checkpoint (hf_quant_config.json + safetensors, as ModelOpt's export_hf_checkpoint writes it)
and, where one is given, the unquantized reference model, and reports findings: severity (error / warning / info),
check, module names, message and likely cause. Exit 0 without an error finding, 1 with one, 2 when the input cannot
be audited at all (no such directory, no hf_quant_config.json, no config.json, a corrupt safetensors header).

The checks, in the order they run (each timed; tensors are streamed one layer at a time, float32 per layer only):

- metadata   config.json's quantization_config agrees with hf_quant_config.json; with a reference: the model config
             (max positions, vocabulary, ...), tokenizer files, chat template and generation config are unchanged.
- coverage   per Linear, the format hf_quant_config.json declares (exclude_modules and per-layer formats honoured)
             against what is stored: 8-bit codes, or plain float weights. Declared but stored plain, or stored
             quantized but declared excluded, is an error; an output head / router / vision module quantized at
             all is a warning. An info finding counts quantized modules per module class.
- scales     every scale tensor (weight_scale, weight_scale_2, input_scale, pre_quant_scale, k_scale, v_scale)
             finite, positive, not underflowed (0 in an FP8 block scale, a float32 subnormal).
- kv_cache   k_scale / v_scale for every attention module when the KV cache is declared FP8, none otherwise,
             and not all exactly 1.0 (a default, not a calibration result).
- format     each quantized layer is built by the QLAYERS class of its declared format, which reads every tensor
             with the dtype and shape that format and its group size imply: a wrong dtype (another format's
             tensors), a scale of the wrong shape, or a missing scale is an error naming the tensor. In mixed-precision
             exports, layers that engines fuse (q/k/v, gate/up, w1/w3) must share format and group size.
- weights    with a reference: per layer, the dequantized weight (QLAYERS' dequantized_weight, times the layer's
             pre_quant_scale, or the scale export folded into the preceding norm, recovered from the norm's change)
             against the reference weight: cosine, SQNR and gain (the factor that best maps it onto the reference;
             halved scales give 2.0), with the bounds of its format (WEIGHT_BOUNDS below).
- tensors    every reference tensor (or, without a reference, every tensor config.json implies) is in the export,
             none dropped by a tied-weight dedupe; unquantized tensors keep their shapes and values (norms that
             export changed by folding AWQ scales into them are recognised by the weights check); no unexplained
             extra tensors.
- canary     with a reference: 2 windows x 128 tokens of held-out pydoc text through the exported checkpoint run
             with deployment numerics (engine=torch's load_exported) and through the reference; top-1 agreement and
             mean KL(ref || export) against the bounds of the format (CANARY_BOUNDS). It catches what tensors alone
             cannot, such as activation scales that saturate.

Bounds were set from healthy exports of every precision (tiny test models and SmolLM2-135M, bench/audit_bench.py)
with a wide margin below the worst healthy value; the damage the audit exists for lands far outside them.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantlab.checkpoint import (
    TOKENIZER_FILES,
    CheckpointTensors,
    LayerFormat,
    QuantConfig,
    read_headers,
    read_quant_config,
    tensor_index,
)
from quantlab.errors import EXIT_GATE_FAILED, EXIT_OK, QuantlabError, cli_guard

log = logging.getLogger("quantlab")

AUDIT_SCHEMA = "quantlab.audit/1"
ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)
CHECKS = ("metadata", "coverage", "scales", "kv_cache", "format", "weights", "tensors", "canary")

QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I8", "U8")  # where codes are stored
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "output_scale", "k_scale",
                  "v_scale")
KV_SUFFIXES = ("k_scale", "v_scale", "k_bias", "v_bias")
F32_TINY = 1.1754944e-38  # smallest normal float32: below it a scale is flushed to zero by FTZ kernels
FP8_TINY = 2.0 ** -6  # smallest normal E4M3
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
HIGH_PRECISION_NAMES = ("lm_head", "embed_out", "output_layer", "gate", "router", "shared_expert_gate")  # last parts
BENIGN_CONFIG_KEYS = ("quantization_config", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
                      "use_cache", "output_attentions", "output_hidden_states", "return_dict")
TOKEN_ID_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")


# ------------------------------------------------------------------------------------------------ bounds
@dataclass(frozen=True)
class WeightBounds:
    """Per-layer bounds of a format, dequantized weight vs reference: an error below cosine_error or sqnr_error_db,
    a warning below sqnr_warn_db. Healthy values (tiny models and SmolLM2-135M): FP8 30-32 dB, INT8 per-channel
    38-47 dB, int4 groups / NVFP4 17-22 dB; cosines 0.99+ for 4-bit formats, 0.999+ for 8-bit ones."""

    cosine_error: float
    sqnr_error_db: float
    sqnr_warn_db: float


@dataclass(frozen=True)
class CanaryBounds:
    """Canary bounds of a format: an error when top-1 agreement falls below top1_error or the mean KL rises over
    kl_error, a warning below top1_warn / over kl_warn."""

    top1_error: float
    top1_warn: float
    kl_error: float
    kl_warn: float


_EIGHT_BIT_WEIGHTS = WeightBounds(cosine_error=0.99, sqnr_error_db=18.0, sqnr_warn_db=24.0)
_FOUR_BIT_WEIGHTS = WeightBounds(cosine_error=0.97, sqnr_error_db=12.0, sqnr_warn_db=15.0)
WEIGHT_BOUNDS: dict[str, WeightBounds] = {
    "FP8": _EIGHT_BIT_WEIGHTS,
    "FP8_PER_CHANNEL_PER_TOKEN": _EIGHT_BIT_WEIGHTS,
    "W8A8_SQ_PER_CHANNEL": WeightBounds(cosine_error=0.995, sqnr_error_db=25.0, sqnr_warn_db=30.0),
    "W4A16_AWQ": _FOUR_BIT_WEIGHTS,
    "W4A8_AWQ": _FOUR_BIT_WEIGHTS,
    "NVFP4": _FOUR_BIT_WEIGHTS,
}
DEFAULT_WEIGHT_BOUNDS = WeightBounds(cosine_error=0.9, sqnr_error_db=6.0, sqnr_warn_db=9.0)
GAIN_ERROR = 0.15  # |gain - 1| over this: the scales are off by a constant factor (halved scales: gain 2)
GAIN_WARN = 0.05
SQNR_CAP, GAIN_CAP = 999.0, 1e6  # report figures stay finite (strict JSON): an exact match reads 999 dB

_EIGHT_BIT_CANARY = CanaryBounds(top1_error=0.7, top1_warn=0.85, kl_error=0.3, kl_warn=0.1)
_FOUR_BIT_CANARY = CanaryBounds(top1_error=0.55, top1_warn=0.7, kl_error=0.8, kl_warn=0.35)
CANARY_BOUNDS: dict[str, CanaryBounds] = {
    "FP8": _EIGHT_BIT_CANARY, "FP8_PER_CHANNEL_PER_TOKEN": _EIGHT_BIT_CANARY, "W8A8_SQ_PER_CHANNEL": _EIGHT_BIT_CANARY,
    "W4A16_AWQ": _FOUR_BIT_CANARY, "W4A8_AWQ": _FOUR_BIT_CANARY, "NVFP4": _FOUR_BIT_CANARY,
}
DEFAULT_CANARY_BOUNDS = CanaryBounds(top1_error=0.5, top1_warn=0.65, kl_error=1.0, kl_warn=0.5)


def weight_bounds(algo: str) -> WeightBounds:
    """The per-layer bounds of a format (a loose default for formats without measured bounds)."""
    return WEIGHT_BOUNDS.get(algo, DEFAULT_WEIGHT_BOUNDS)


def canary_bounds(algos: set[str]) -> CanaryBounds:
    """The loosest bounds among the formats present (a mixed export is judged by its most aggressive format)."""
    found = [CANARY_BOUNDS.get(a, DEFAULT_CANARY_BOUNDS) for a in algos] or [DEFAULT_CANARY_BOUNDS]
    return CanaryBounds(min(b.top1_error for b in found), min(b.top1_warn for b in found),
                        max(b.kl_error for b in found), max(b.kl_warn for b in found))


# ---------------------------------------------------------------------------------------------- findings
@dataclass
class Finding:
    """One thing the audit found: how bad it is, which check found it, the modules (or tensors) concerned, what is
    wrong and what most likely caused it."""

    severity: str  # error | warning | info
    check: str  # one of CHECKS
    modules: list[str]
    message: str
    cause: str = ""

    def to_dict(self) -> dict:
        """Plain JSON types."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        """The inverse of to_dict."""
        return cls(d["severity"], d["check"], list(d.get("modules") or []), d["message"], d.get("cause", ""))


@dataclass
class AuditReport:
    """What an audit found, with per-check timings, per-layer weight statistics and the canary's figures."""

    checkpoint: str
    reference: str | None
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    findings: list[Finding] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per check, and "total"
    layers: list[dict] = field(default_factory=list)  # module, format, cosine, sqnr_db, gain, fold
    canary: dict | None = None  # windows, tokens, positions, top1, kl_mean, kl_p99, nll ratio, bounds, seconds
    skipped: list[str] = field(default_factory=list)  # checks not run, with why

    @property
    def errors(self) -> list[Finding]:
        """The error findings: any of them fails the audit (exit 1, the pipeline stops)."""
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        """The warning findings: worth a look, never a failure."""
        return [f for f in self.findings if f.severity == WARNING]

    @property
    def passed(self) -> bool:
        """No error finding."""
        return not self.errors

    def summary(self) -> dict[str, int]:
        """Number of findings per severity: {"error": n, "warning": n, "info": n}."""
        return {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}

    def find(self, check: str, severity: str | None = None) -> list[Finding]:
        """The findings of one check (and severity)."""
        return [f for f in self.findings if f.check == check and (severity is None or f.severity == severity)]

    def to_dict(self) -> dict:
        """The report as plain JSON types (audit.json, --json): schema, checkpoint, reference, quant_algo,
        kv_cache_quant_algo, passed, summary, findings, timings, layers, canary, skipped."""
        return {"schema": AUDIT_SCHEMA, "checkpoint": self.checkpoint, "reference": self.reference,
                "quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo,
                "passed": self.passed, "summary": self.summary(), "findings": [f.to_dict() for f in self.findings],
                "timings": self.timings, "layers": self.layers, "canary": self.canary, "skipped": self.skipped}

    @classmethod
    def from_dict(cls, d: dict) -> AuditReport:
        """The inverse of to_dict; a report of another schema version is refused."""
        if d.get("schema") != AUDIT_SCHEMA:
            raise QuantlabError(f"audit report schema {d.get('schema')!r} is not {AUDIT_SCHEMA}",
                                fix="rerun the audit with this version of quantlab")
        return cls(d["checkpoint"], d.get("reference"), d.get("quant_algo"), d.get("kv_cache_quant_algo"),
                   [Finding.from_dict(f) for f in d.get("findings", [])], dict(d.get("timings", {})),
                   list(d.get("layers", [])), d.get("canary"), list(d.get("skipped", [])))

    def render(self, show_info: bool = True) -> str:
        """Plain text for a terminal: findings grouped by severity, each with its modules and likely cause."""
        lines = [f"quantlab audit of {self.checkpoint}",
                 f"  format: {self.quant_algo}, kv cache: {self.kv_cache_quant_algo or 'not quantized'}; "
                 f"reference: {self.reference or 'none'}"]
        for severity in SEVERITIES:
            found = [f for f in self.findings if f.severity == severity]
            if not found or (severity == INFO and not show_info):
                continue
            lines.append(f"\n{severity.upper()}S ({len(found)})" if severity != INFO else f"\nINFO ({len(found)})")
            for f in found:
                lines.append(f"  [{f.check}] {f.message}")
                if f.modules:
                    lines.append(f"      modules: {abbreviate(f.modules)}")
                if f.cause:
                    lines.append(f"      likely cause: {f.cause}")
        for why in self.skipped:
            lines.append(f"  skipped: {why}")
        counts = self.summary()
        verdict = "FAIL" if counts[ERROR] else "PASS"
        lines.append(f"\nquantlab audit: {verdict}: {counts[ERROR]} error(s), {counts[WARNING]} warning(s), "
                     f"{counts[INFO]} info in {self.timings.get('total', 0.0):.1f} s")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- helpers
def _natural(name: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def _ranges(values: list[int]) -> str:
    values = sorted(set(values))
    spans, start = [], values[0]
    for prev, cur in zip(values, values[1:] + [None], strict=True):
        if cur is None or cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return spans[0] if len(spans) == 1 and "-" not in spans[0] else "{" + ",".join(spans) + "}"


def abbreviate(names: list[str], limit: int = 8) -> str:
    """Module names for a message: all of them when few, else one pattern per module class with the indices
    compressed (model.layers.{0-29}.mlp.down_proj (30))."""
    names = sorted(set(names), key=_natural)
    if len(names) <= limit:
        return ", ".join(names)
    groups: dict[tuple, list[list[int]]] = {}
    for name in names:
        parts = name.split(".")
        template = tuple("#" if p.isdigit() else p for p in parts)
        groups.setdefault(template, []).append([int(p) for p in parts if p.isdigit()])
    out = []
    for template, indices in groups.items():
        columns = iter(zip(*indices, strict=True)) if indices and indices[0] else iter(())
        parts = [_ranges(list(next(columns))) if p == "#" else p for p in template]
        text = ".".join(parts)
        out.append(f"{text} ({len(indices)})" if len(indices) > 1 else text)
    shown = out[:limit]
    return "; ".join(shown) + (f"; and {len(out) - limit} more module classes" if len(out) > limit else "")


def module_class(name: str) -> str:
    """model.layers.3.mlp.experts.5.w1 -> model.layers.*.mlp.experts.*.w1"""
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def _block_of(module: str) -> str:
    """The decoder block a module belongs to (the prefix up to its last numeric part), "" at the top level."""
    parts = module.split(".")
    numeric = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[: numeric[0] + 1]) if numeric else ""


def _read_json(path: Path, what: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise QuantlabError(f"{what} {path} is not valid JSON ({str(exc)[:120]})",
                            fix="re-export or re-save the checkpoint; the file is damaged") from None
    if not isinstance(doc, dict):
        raise QuantlabError(f"{what} {path} is not a JSON object", fix="re-export or re-save the checkpoint")
    return doc


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


# ------------------------------------------------------------------------------------------------- layout
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


def _layout(ckpt: Path) -> Layout:
    """Built on the meta device from the export's config.json (no memory, ~0.1 s)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(ckpt)
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


# ------------------------------------------------------------------------------------------------- audit
class _Audit:
    """One audit: the inputs, the findings so far, and one method per check."""

    def __init__(self, ckpt: Path, quant: QuantConfig, config: dict, tensors: CheckpointTensors, ref, device, dtype):
        self.ckpt, self.quant, self.config, self.t = ckpt, quant, config, tensors
        self.ref = ref  # ModelRef or None
        self.device, self.dtype = device, dtype
        self.ref_headers = read_headers(ref.path) if ref else None
        self.ref_index = tensor_index(ref.path) if ref else None
        self.layout = _layout(ckpt)
        self.findings: list[Finding] = []
        self.layers: list[dict] = []
        self.canary: dict | None = None
        self.skipped: list[str] = []
        self.folded: set[str] = set()  # 1-D tensors whose change a fold of AWQ scales explains
        self._vectors: dict[str, list] = {}  # block -> its 1-D tensors that differ from the reference
        self._like: dict[tuple, str | None] = {}  # (declared, tensor suffix, stored dtype) -> format the tensors fit
        self.declared = {m: quant.format_of(m) for m in self.layout.linears}
        self.stored = {m: self._stored_state(m) for m in self.layout.linears}

    # -------------------------------------------------------------------------------- small utilities
    def add(self, severity: str, check: str, modules, message: str, cause: str = "") -> None:
        self.findings.append(Finding(severity, check, sorted(set(modules), key=_natural), message, cause))

    def _stored_state(self, module: str) -> str:
        dtype = self.t.dtype_of(f"{module}.weight")
        if dtype is None:
            return "missing"
        return "quantized" if dtype in QUANTIZED_DTYPES else "float"

    def ref_tensor(self, name: str):
        return self.ref_index[name].get_tensor(name) if self.ref_index and name in self.ref_index else None

    def quantized_modules(self) -> list[str]:
        return [m for m in self.layout.linears if self.declared[m] is not None and self.stored[m] == "quantized"]

    # ------------------------------------------------------------------------------------------ metadata
    def check_metadata(self) -> None:
        q, declared = self.config.get("quantization_config"), self.quant
        if not isinstance(q, dict):
            self.add(ERROR, "metadata", [], "config.json has no quantization_config although hf_quant_config.json "
                     f"declares {declared.quant_algo}",
                     "config.json was replaced by the unquantized model's (copied over the export, or saved again by "
                     "transformers): vLLM / transformers then load the stored codes as plain weights")
        else:
            if q.get("quant_algo") != declared.quant_algo:
                self.add(ERROR, "metadata", [], f"config.json says quant_algo={q.get('quant_algo')}, "
                         f"hf_quant_config.json says {declared.quant_algo}",
                         "one of the two files was edited or comes from another export; loaders read one or the other")
            kv_scheme = q.get("kv_cache_scheme")
            if bool(kv_scheme) != bool(declared.kv_cache_quant_algo):
                self.add(ERROR, "metadata", [], f"config.json {'has' if kv_scheme else 'has no'} kv_cache_scheme, "
                         f"hf_quant_config.json says kv_cache_quant_algo={declared.kv_cache_quant_algo}",
                         "the two files disagree on the KV cache: engines reading config.json run another cache")
            ignore = q.get("ignore")
            if not declared.mixed and isinstance(ignore, list) and sorted(ignore) != sorted(declared.exclude_modules):
                only_cfg = sorted(set(ignore) - set(declared.exclude_modules))
                only_hf = sorted(set(declared.exclude_modules) - set(ignore))
                self.add(ERROR, "metadata", only_cfg + only_hf, "config.json quantization_config.ignore and "
                         "hf_quant_config.json exclude_modules list different modules",
                         "one of the files was edited: engines reading the other quantize (or keep) other modules")
        if self.ref is None:
            self.skipped.append("metadata against the reference (no --reference): model config, tokenizer, chat "
                                "template and generation config not compared")
            return
        self._compare_config()
        self._compare_tokenizer()
        self._compare_generation_config()

    def _compare_config(self) -> None:
        ref_cfg, cfg = self.ref.config, self.config
        changed = [k for k in sorted(set(ref_cfg) | set(cfg)) if k not in BENIGN_CONFIG_KEYS
                   and ref_cfg.get(k) != cfg.get(k) and not (k == "architectures" and not ref_cfg.get(k))]
        if changed:
            shown = ", ".join(f"{k}: {json.dumps(ref_cfg.get(k))[:60]} -> {json.dumps(cfg.get(k))[:60]}"
                              for k in changed[:6])
            self.add(ERROR, "metadata", [], f"config.json differs from the reference's in {len(changed)} key(s): "
                     f"{shown}",
                     "the export was made from another model or another config (a resized context window, a changed "
                     "rope scaling or vocabulary), or config.json was edited after export: engines build a model "
                     "other than the one calibrated")

    def _compare_tokenizer(self) -> None:
        """Same tokenization as the reference: vocabulary, special tokens and the ids of a sample text (files that
        differ only in bytes, e.g. re-saved by another library version, are an info finding), and chat template."""
        ref_dir = self.ref.path
        files = [n for n in TOKENIZER_FILES if (ref_dir / n).is_file()]
        missing = [n for n in files if not (self.ckpt / n).is_file()]
        differ = [n for n in files if n not in missing and not _same_file(ref_dir / n, self.ckpt / n)]
        if not any((self.ckpt / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            self.add(WARNING, "metadata", [], "the export has no tokenizer (tokenizer.json, tokenizer.model or "
                     "vocab.json)", "export_hf_checkpoint() writes no tokenizer: copy the reference's tokenizer files "
                     "beside the export (quantlab's export stage does); engines need one")
        else:
            if missing:
                self.add(WARNING, "metadata", [], f"tokenizer file(s) of the reference missing from the export: "
                         f"{', '.join(missing)}", "only part of the tokenizer was copied beside the export")
            if differ or missing:
                changes = _tokenizer_changes(ref_dir, self.ckpt)
                if changes:
                    self.add(ERROR, "metadata", [], f"the export's tokenizer differs from the reference's: "
                             f"{'; '.join(changes)}", "the tokenizer was taken from another model or version, or "
                             "edited: token ids in deployment are not the ones calibrated and evaluated")
                elif differ:
                    self.add(INFO, "metadata", [], f"tokenizer file(s) {', '.join(differ)} differ in bytes from the "
                             "reference's but tokenize identically (vocabulary, special tokens, sample ids)")
        ref_template, template = _chat_template(ref_dir), _chat_template(self.ckpt)
        if ref_template and not template:
            self.add(ERROR, "metadata", [], "the reference has a chat template, the export has none",
                     "chat_template.jinja or tokenizer_config.json's chat_template was not copied with the export: "
                     "chat requests are formatted as plain text")
        elif template != ref_template:
            self.add(ERROR, "metadata", [], "the export's chat template differs from the reference's"
                     + ("" if ref_template else " (the reference has none)"),
                     "the tokenizer files come from another model or version: prompts are formatted differently "
                     "from the ones the model was trained and evaluated with")

    def _compare_generation_config(self) -> None:
        ref_gen = _read_json(self.ref.path / "generation_config.json", "generation config")
        gen = _read_json(self.ckpt / "generation_config.json", "generation config")
        if ref_gen is None:
            return
        if gen is None:
            self.add(WARNING, "metadata", [], "the reference has a generation_config.json, the export has none",
                     "the file was not copied with the export: engines fall back to their default stop tokens")
            return
        changed = [k for k in sorted(set(ref_gen) | set(gen)) if k != "transformers_version"
                   and ref_gen.get(k) != gen.get(k)]
        ids = [k for k in changed if k in TOKEN_ID_KEYS]
        if changed:
            shown = ", ".join(f"{k}: {json.dumps(ref_gen.get(k))} -> {json.dumps(gen.get(k))}" for k in changed[:6])
            self.add(ERROR if ids else WARNING, "metadata", [], f"generation_config.json differs from the "
                     f"reference's: {shown}", "the export wrote the generation config of the model object it was "
                     "given (an edited or default one): stop tokens / sampling defaults change in deployment")

    # ------------------------------------------------------------------------------------------ coverage
    def check_coverage(self) -> None:
        lay = self.layout
        plain_declared, identical, stray, policy = [], [], [], []
        for module in lay.linears:
            fmt, state = self.declared[module], self.stored[module]
            if fmt is not None and state == "float":
                plain_declared.append(module)
                ref_w = self.ref_tensor(f"{module}.weight")
                if ref_w is not None:
                    ours = self.t.get(f"{module}.weight")
                    if ours.shape == ref_w.shape and bool((ours.float() == ref_w.float()).all()):
                        identical.append(module)
            elif fmt is None and state == "quantized":
                stray.append(module)
            if fmt is not None and _kept_high_precision(module, lay.head):
                policy.append(module)
        if plain_declared:
            algos = sorted({self.declared[m].quant_algo for m in plain_declared})
            dtypes = sorted({self.t.dtype_of(f"{m}.weight") for m in plain_declared})
            same = (f"; {len(identical)} of them identical to the reference weights" if identical else "")
            placeholders = [m for m in plain_declared if f"{m}.weight_scale" in self.t]
            extra = f"; {len(placeholders)} carry scale tensors beside float weights" if placeholders else ""
            self.add(ERROR, "coverage", plain_declared, f"{len(plain_declared)} module(s) declared {', '.join(algos)} "
                     f"by hf_quant_config.json are stored unquantized ({', '.join(dtypes)} weights){same}{extra}",
                     "their quantizers were disabled or never calibrated (an MoE expert that received no calibration "
                     "tokens, a module class the recipe's patterns missed), or export wrote the original weights: the "
                     "output is not quantized although the checkpoint says it is")
        if stray:
            self.add(ERROR, "coverage", stray, f"{len(stray)} module(s) are stored quantized "
                     f"({', '.join(sorted({self.t.dtype_of(m + '.weight') for m in stray}))} codes) although "
                     "hf_quant_config.json " + ("does not list them" if self.quant.mixed else "excludes them"),
                     "a quantizer stayed enabled on a module the recipe keeps in high precision (output head, "
                     "vision tower, router), or exclude_modules was edited: loaders that honour the config read the "
                     "codes as plain weights")
        if policy:
            self.add(WARNING, "coverage", policy, f"{len(policy)} output head / router / vision module(s) are "
                     "quantized", "ModelOpt's recipes keep these in high precision; a pattern such as *lm_head* did "
                     "not match (renamed module), or a search chose it: check the quality cost")
        per_class: dict[str, list] = {}
        for module in lay.linears:
            fmt = self.declared[module]
            label = fmt.quant_algo if fmt is not None and self.stored[module] == "quantized" else "high precision"
            per_class.setdefault(module_class(module), []).append(label)
        parts = []
        for cls, labels in per_class.items():
            counts = {x: labels.count(x) for x in sorted(set(labels))}
            parts.append(f"{cls} " + ", ".join(f"{n}/{len(labels)} {x}" for x, n in counts.items()))
        self.add(INFO, "coverage", [], "quantized per module class: " + "; ".join(parts))

    # -------------------------------------------------------------------------------------------- scales
    def check_scales(self) -> None:
        import torch

        kinds: dict[str, list[str]] = {}
        worst: dict[str, str] = {}
        for name in self.t.names():
            suffix = name.rpartition(".")[2]
            if suffix not in SCALE_SUFFIXES:
                continue
            dtype = self.t.dtype_of(name)
            v = self.t.get(name).float()
            finite = torch.isfinite(v)
            problems = []
            if not bool(finite.all()):
                problems.append(("nonfinite", f"{name}: {int((~finite).sum())} NaN/Inf of {v.numel()}"))
            if bool((v[finite] < 0).any()):
                problems.append(("negative", f"{name}: {int((v < 0).sum())} negative, "
                                              f"min {float(v[finite].min()):.3g}"))
            zeros = int((v == 0).sum())
            if zeros:
                kind = "fp8_zero" if dtype.startswith("F8") else "zero"
                problems.append((kind, f"{name}: {zeros} of {v.numel()} are 0"))
            if dtype in FLOAT_DTYPES and bool(((v > 0) & (v < F32_TINY)).any()):
                problems.append(("subnormal", f"{name}: {float(v[v > 0].min()):.3g}"))
            if dtype.startswith("F8"):
                tiny = int(((v > 0) & (v < FP8_TINY)).sum())
                if tiny > max(1, v.numel() // 100):
                    problems.append(("fp8_subnormal", f"{name}: {tiny} of {v.numel()} below 2^-6"))
            for kind, text in problems:
                kinds.setdefault(kind, []).append(name)
                worst.setdefault(kind, text)
        texts = {
            "nonfinite": (ERROR, "scale tensor(s) hold NaN or Inf",
                          "calibration saw NaN/Inf (an overflowing fp16 forward, a NaN weight) or divided by an amax "
                          "of 0: every output through these layers is NaN"),
            "negative": (ERROR, "scale tensor(s) hold negative values",
                         "a scale is amax / qmax and cannot be negative: the tensor was written from the wrong buffer "
                         "or damaged"),
            "zero": (ERROR, "scale tensor(s) are 0",
                     "amax was 0: a layer that saw no calibration data (an MoE expert routed no tokens), or a scale "
                     "that underflowed when cast to a narrower type: dequantization gives 0, division gives Inf"),
            "fp8_zero": (ERROR, "FP8 block scale(s) underflowed to 0",
                         "per-block scales far below the tensor's largest block round to 0 in E4M3 (the per-block "
                         "scale underflow bug): those blocks dequantize to zeros; exporters must clamp them to 2^-9"),
            "subnormal": (ERROR, "scale tensor(s) are float32 subnormals (< 1.2e-38)",
                          "a scale this small is flushed to zero by FTZ kernels; it comes from an amax of ~0 or a "
                          "unit error (amax divided twice)"),
            "fp8_subnormal": (WARNING, "FP8 block scales: more than 1% are E4M3 subnormals (< 2^-6)",
                              "blocks much smaller than the tensor's largest are stored with fewer than 3 mantissa "
                              "bits: the per-tensor scale (weight_scale_2) is dominated by outliers"),
        }
        for kind, names in kinds.items():
            severity, what, cause = texts[kind]
            modules = sorted({n.rpartition(".")[0] for n in names}, key=_natural)
            self.add(severity, "scales", modules, f"{len(names)} {what} (e.g. {worst[kind]})", cause)

    # ------------------------------------------------------------------------------------------ kv cache
    def check_kv_cache(self) -> None:
        present = [n for n in self.t.names() if n.rpartition(".")[2] in ("k_scale", "v_scale")]
        if not self.quant.kv_cache_quant_algo:
            if present:
                self.add(ERROR, "kv_cache", sorted({n.rpartition(".")[0] for n in present}),
                         f"{len(present)} k_scale / v_scale tensors, but hf_quant_config.json declares no KV cache "
                         "quantization", "kv_cache_quant_algo was lost from the config (edited, or written by another "
                         "tool): engines run an unquantized cache, not the one calibrated")
            return
        missing = [a for a in self.layout.attention
                   if f"{a}.k_proj.k_scale" not in self.t or f"{a}.v_proj.v_scale" not in self.t]
        if missing:
            self.add(ERROR, "kv_cache", missing, f"kv_cache_quant_algo={self.quant.kv_cache_quant_algo} but "
                     f"{len(missing)} of {len(self.layout.attention)} attention module(s) have no k_scale / v_scale "
                     f"(expected at <attention>.k_proj.k_scale and <attention>.v_proj.v_scale)",
                     "the KV quantizers of these layers were disabled or never calibrated, or export did not write "
                     "them: engines fall back to scale 1.0 or refuse the checkpoint")
        if not present:
            return
        values = {n: float(self.t.get(n).float().reshape(-1)[0]) for n in present if self.t.shape_of(n) in ((), (1,))}
        ones = [n for n, v in values.items() if v == 1.0]
        if ones and len(ones) == len(values) and len(values) > 1:
            self.add(ERROR, "kv_cache", sorted({n.rpartition(".")[0] for n in ones}),
                     f"all {len(values)} KV cache scales are exactly 1.0",
                     "a default, not a calibration result: the KV quantizers were never calibrated (the recipe's "
                     "KV entries did not match the attention modules), or the exporter clamped every scale to >= 1.0; "
                     "K/V above 448 saturate and the cache is not the one evaluated")
        elif ones:
            self.add(WARNING, "kv_cache", sorted({n.rpartition(".")[0] for n in ones}),
                     f"{len(ones)} of {len(values)} KV cache scales are exactly 1.0",
                     "these layers' KV quantizers were probably not calibrated (scale left at its default)")

    # ------------------------------------------------------------------------------ format and weights
    def check_layers(self) -> None:
        """Build every quantized layer with the QLAYERS class of its declared format ("format"), then compare its
        dequantized weight with the reference ("weights")."""
        import torch

        from quantlab.engines.qlayers import QLAYERS, LayerContext

        ctx = LayerContext("cpu", False, torch.float32)
        refusals: dict[tuple, list] = {}
        unknown: dict[str, list] = {}
        stats: list[dict] = []
        for module in self.quantized_modules():
            fmt: LayerFormat = self.declared[module]
            if fmt.quant_algo not in QLAYERS:
                unknown.setdefault(fmt.quant_algo, []).append(module)
                continue
            out_f, in_f, has_bias = self.layout.linears[module]
            probe = _Probe(self.t)
            try:
                layer = QLAYERS[fmt.quant_algo].from_checkpoint(module, out_f, in_f, has_bias, probe, fmt, ctx)
            except QuantlabError as exc:
                self._refused(module, fmt, probe.refusal, exc, refusals)
                continue
            except (RuntimeError, ValueError, IndexError) as exc:  # tensors the format cannot even unpack
                self._refused(module, fmt, None, QuantlabError(f"{type(exc).__name__}: {str(exc)[:160]}"), refusals)
                continue
            if self.ref_index is not None:
                row = self._compare_weight(module, fmt, layer)
                if row:
                    stats.append(row)
            del layer
        self._report_refusals(refusals)
        for algo, modules in unknown.items():
            self.add(INFO, "format", modules, f"{len(modules)} layer(s) in format {algo}, which quantlab cannot "
                     f"dequantize (it knows {', '.join(QLAYERS)}): their scales' shapes and weights were not audited")
        self._check_fused_groups()
        self.layers = stats
        if self.ref_index is None:
            self.skipped.append("weights: dequantized weights vs the reference (no --reference)")
            return
        self._judge_weights(stats)

    def _refused(self, module: str, fmt: LayerFormat, refusal, exc: QuantlabError, out: dict) -> None:
        """Group a layer's refusal with others of the same kind: (check, kind, declared format, tensor suffix, what
        was found) -> [(module, one line about it)]."""
        algo, group = fmt.quant_algo, f" group_size {fmt.group_size}" if fmt.group_size else ""
        if refusal is None:  # refused on values (reported by the scales check) or on the group size
            if "non-positive or non-finite" not in exc.problem:
                out.setdefault(("format", "unreadable", f"{algo}{group}", "", ""), []).append((module, exc.problem))
            return
        kind, tensor, found, wanted = refusal
        suffix = tensor.rpartition(".")[2]
        check = "scales" if suffix in SCALE_SUFFIXES else "format"
        if kind == "missing":
            out.setdefault((check, "missing", algo, suffix, ""), []).append((module, tensor))
        elif kind == "dtype":
            out.setdefault(("format", "dtype", algo, suffix, found), []).append((module, f"{tensor} ({found}, "
                                                                                         f"{algo} stores {wanted})"))
        else:
            out.setdefault((check, "shape", f"{algo}{group}", suffix, ""), []).append(
                (module, f"{tensor} has shape {found}, {algo}{group} needs {wanted}"))

    def _report_refusals(self, refusals: dict) -> None:
        for (check, kind, algo, suffix, found), entries in refusals.items():
            modules, example, n = [m for m, _ in entries], entries[0][1], len(entries)
            if kind == "unreadable":
                self.add(ERROR, check, modules, f"{n} layer(s) cannot be read as {algo}: {example}",
                         "hf_quant_config.json does not match the tensors")
            elif kind == "missing":
                self.add(ERROR, check, modules, f"{n} layer(s) declared {algo} have no {suffix} tensor (e.g. "
                         f"{example})", _MISSING_CAUSE.get(suffix, "export did not write it"))
            elif kind == "dtype":
                key = (algo, suffix, found)
                if key not in self._like:
                    self._like[key] = _looks_like(self.t, modules[0], self.layout.linears[modules[0]],
                                                  self.declared[modules[0]])
                like = f"; the tensors read as {self._like[key]}" if self._like[key] else ""
                self.add(ERROR, check, modules, f"{n} layer(s) declared {algo} store their {suffix} as {found} "
                         f"(e.g. {example}){like}",
                         "hf_quant_config.json declares another format than the one written (an edited config, a "
                         "config from another export, or a mixed-precision export whose per-layer list is wrong): "
                         "engines misread every such layer")
            else:
                self.add(ERROR, check, modules, f"{n} layer(s): {suffix} shapes do not match {algo} (e.g. {example})",
                         "the group size in hf_quant_config.json is not the one the weights were quantized with, or "
                         "scales were transposed / concatenated wrongly (fused layers, sharded writers)")

    def _compare_weight(self, module: str, fmt: LayerFormat, layer) -> dict | None:
        """The layer's stored weight against the reference in the space the quantizer worked in: a smoothed layer
        stores W / s (s its pre_quant_scale, or the scale export folded into the norm ahead of it), so the
        dequantized weight is compared with W_ref / s, where every output channel's error is the quantizer's own."""
        ref_w = self.ref_tensor(f"{module}.weight")
        if ref_w is None:
            return None
        ref_w = ref_w.float()
        deq = layer.dequantized_weight().float()
        if deq.shape != ref_w.shape:
            self.add(ERROR, "weights", [module], f"dequantized weight has shape {list(deq.shape)}, the reference "
                     f"{list(ref_w.shape)}", "the export was made from another model")
            return None
        pqs = getattr(layer, "pre_quant_scale", None)
        if pqs is not None:
            candidates = [("pre_quant_scale", pqs.float())]
        else:
            candidates = [(None, None), *self._fold_candidates(module, deq.shape[1])]
        best = None
        for fold, scale in candidates:
            row = _weight_stats(ref_w if scale is None else ref_w / scale[None, :], deq)
            if best is None or row["sqnr_db"] > best[1]["sqnr_db"]:
                best = (fold, row)
        fold, row = best
        if fold and fold != "pre_quant_scale":
            self.folded.add(fold)
        return {"module": module, "format": fmt.quant_algo, **row, "fold": fold}

    def _fold_candidates(self, module: str, width: int):
        """Per-input scales export may have folded into a norm ahead of this layer (AWQ layers sharing an input):
        exported / reference value of each changed 1-D tensor of the same block, and (1+w) norms' (1+w') / (1+w)."""
        import torch

        block = _block_of(module)
        if block not in self._vectors:
            self._vectors[block] = []
            for name in self.t.names():
                ref = self.ref_tensor(name) if _block_of(name) == block else None
                if ref is None or ref.dim() != 1 or self.t.dtype_of(name) not in FLOAT_DTYPES:
                    continue
                ours, ref = self.t.get(name).float(), ref.float()
                if ours.shape == ref.shape and not torch.equal(ours, ref):
                    self._vectors[block].append((name, ours, ref))
        for name, ours, ref in self._vectors[block]:
            if ours.shape[0] != width:
                continue
            for new, old in ((ours, ref), (1 + ours, 1 + ref)):
                ratio = new / torch.where(old.abs() > 1e-12, old, torch.ones_like(old))
                yield name, torch.where((old.abs() > 1e-12) & (ratio.abs() > 1e-12), ratio, torch.ones_like(ratio))

    def _judge_weights(self, stats: list[dict]) -> None:
        direction, noise, noisy, gain_bad, gain_warn = [], [], [], [], []
        for row in stats:
            b = weight_bounds(row["format"])
            if row["cosine"] < b.cosine_error:
                direction.append(row)
            elif row["sqnr_db"] < b.sqnr_error_db:
                noise.append(row)
            elif row["sqnr_db"] < b.sqnr_warn_db:
                noisy.append(row)
            if abs(row["gain"] - 1) > GAIN_ERROR:
                gain_bad.append(row)
            elif abs(row["gain"] - 1) > GAIN_WARN:
                gain_warn.append(row)

        def describe(rows: list[dict]) -> str:
            rows = sorted(rows, key=lambda r: r["sqnr_db"])
            shown = ", ".join(f"{r['module']} cosine {r['cosine']:.4f} SQNR {r['sqnr_db']:.1f} dB gain "
                              f"{r['gain']:.3f}" for r in rows[:3])
            return shown + (f" (and {len(rows) - 3} more)" if len(rows) > 3 else "")

        def bounds_text(rows: list[dict]) -> str:
            return "; ".join(f"{a}: error below cosine {weight_bounds(a).cosine_error} / "
                             f"{weight_bounds(a).sqnr_error_db} dB" for a in sorted({r["format"] for r in rows}))

        if direction:
            self.add(ERROR, "weights", [r["module"] for r in direction], f"{len(direction)} layer(s) dequantize to "
                     f"weights pointing elsewhere than the reference's: {describe(direction)} "
                     f"({bounds_text(direction)})",
                     "codes and scales do not belong together: scales of another layer or block size, codes packed "
                     "in another order, layers swapped or renamed, or weights quantized from another model; a "
                     "low-memory export path that mis-scaled blocks gave cosine 0.756 with half-sized scales")
        if noise:
            self.add(ERROR, "weights", [r["module"] for r in noise], f"{len(noise)} layer(s) dequantize with far "
                     f"more error than the format allows: {describe(noise)} ({bounds_text(noise)})",
                     "scales off by a factor (see gain), clipped or saturated codes, or an amax calibrated on the "
                     "wrong tensor")
        if noisy:
            self.add(WARNING, "weights", [r["module"] for r in noisy], f"{len(noisy)} layer(s) dequantize with more "
                     f"error than healthy exports of their format: {describe(noisy)}",
                     "outlier weights stretching the scales (check the layer), or an aggressive clipping search")
        if gain_bad:
            self.add(ERROR, "weights", [r["module"] for r in gain_bad], f"{len(gain_bad)} layer(s) are scaled by a "
                     "constant factor against the reference (gain = the factor that maps them back; 1.0 when "
                     f"healthy): {describe(gain_bad)}",
                     "weight scales halved / doubled or a per-tensor scale (weight_scale_2, a global scale) applied "
                     "twice or not at all, as in the low-memory NVFP4 export with half-sized scales")
        elif gain_warn:
            self.add(WARNING, "weights", [r["module"] for r in gain_warn], f"{len(gain_warn)} layer(s) are scaled by "
                     f"more than {GAIN_WARN:.0%} against the reference: {describe(gain_warn)}",
                     "a clipping search shrank the scales, or a scale is slightly off")
        if stats:
            worst = min(stats, key=lambda r: r["sqnr_db"])
            self.add(INFO, "weights", [], f"{len(stats)} quantized layers compared with the reference: SQNR "
                     f"{min(r['sqnr_db'] for r in stats):.1f}-{max(r['sqnr_db'] for r in stats):.1f} dB (worst "
                     f"{worst['module']}), cosine >= {min(r['cosine'] for r in stats):.4f}, gain "
                     f"{min(r['gain'] for r in stats):.3f}-{max(r['gain'] for r in stats):.3f}")

    def _check_fused_groups(self) -> None:
        """Mixed precision: layers that engines fuse share format and group size: q/k/v, gate/up, w1/w3 of one
        parent, and each projection across the experts of one MoE layer (grouped expert kernels)."""
        if not self.quant.mixed:
            return
        groups: dict[tuple, list[str]] = {}
        for module in self.layout.linears:
            parent, _, leaf = module.rpartition(".")
            for names in FUSED_SIBLINGS:
                if leaf in names:
                    groups.setdefault(("siblings", parent, names), []).append(module)
            experts = re.match(r"^(.*\.experts)\.\d+\.([^.]+)$", module)
            if experts:
                groups.setdefault(("experts", experts.group(1), experts.group(2)), []).append(module)
        bad = [sorted(members, key=_natural) for members in groups.values()
               if len({_format_label(self.declared[m]) for m in members}) > 1]
        if bad:
            example = ", ".join(f"{m}={_format_label(self.declared[m])}" for m in bad[0][:4])
            self.add(ERROR, "format", [m for members in bad for m in members], f"{len(bad)} group(s) of layers that "
                     f"engines fuse have different formats or group sizes (e.g. {example})",
                     "export checks equal formats only when the group's first member is not FP8 (\"Modules have "
                     "different quantization formats\"), and never across experts: a per-layer search, a hand "
                     "config, or experts that received no calibration tokens left one group in several formats; "
                     "engines fusing q/k/v, gate/up or the experts refuse it or run one format for all")

    # ------------------------------------------------------------------------------------------- tensors
    def check_tensors(self) -> None:
        import torch

        source = ({n: tuple(h["shape"]) for n, h in self.ref_headers.items()} if self.ref_headers is not None
                  else self.layout.expected)
        where = "the reference" if self.ref_headers is not None else "config.json's model"
        quantized = set(self.quantized_modules()) | {m for m, s in self.stored.items() if s == "quantized"}
        missing = [n for n in source if n not in self.t]
        head_weight = f"{self.layout.head}.weight" if self.layout.head else None
        dropped = [n for n in missing if n == head_weight or n.rpartition(".")[0] in self.layout.embeddings]
        others = [n for n in missing if n not in dropped]
        if dropped:
            untied = self.ref is not None and not self.ref.config.get("tie_word_embeddings", False)
            self.add(ERROR, "tensors", [n.rpartition(".")[0] for n in dropped], f"{', '.join(dropped)} "
                     f"of {where} {'is' if len(dropped) == 1 else 'are'} missing from the export"
                     + (" (the reference does not tie the output head to the input embedding)" if untied else ""),
                     "a tied-weight dedupe treated an untied output head and input embedding as one tensor and dropped "
                     "one: loaders initialise it randomly or tie it silently")
        if others:
            self.add(ERROR, "tensors", sorted({n.rpartition(".")[0] for n in others}, key=_natural),
                     f"{len(others)} tensor(s) of {where} missing from the export (e.g. {', '.join(others[:3])})",
                     "export skipped them: modules it did not recognise (MoE experts in a layout it could not "
                     "iterate, renamed by a conversion mapping) or a dedupe of weights it took for copies")
        known = set(source)
        owners = set(self.layout.linears) | set(self.layout.attention)
        unexpected = [n for n in self.t.names() if n not in known and not (
            n.rpartition(".")[2] in SCALE_SUFFIXES + KV_SUFFIXES
            and (n.rpartition(".")[0] in owners or n.rpartition(".")[0].rpartition(".")[0] in owners))]
        if unexpected:
            self.add(WARNING, "tensors", sorted({n.rpartition(".")[0] for n in unexpected}, key=_natural),
                     f"{len(unexpected)} tensor(s) in the export that {where} does not have (e.g. "
                     f"{', '.join(unexpected[:3])})", "tensors of another model or a renamed module: loaders report "
                     "them as unexpected and ignore them")
        if self.ref_index is None:
            return
        reshaped, changed, changed_1d, refolded = [], [], [], []
        for name in source:
            if name not in self.t or self.t.dtype_of(name) not in FLOAT_DTYPES or (
                    name.endswith(".weight") and name.rpartition(".")[0] in quantized):
                continue
            ours = self.t.get(name)
            if tuple(ours.shape) != source[name]:
                reshaped.append(f"{name} {list(ours.shape)} (reference {list(source[name])})")
                continue
            ref = self.ref_tensor(name)
            if torch.equal(ref.to(ours.dtype), ours):
                continue
            if name in self.folded:
                refolded.append(name)
                continue
            a, b = ref.float().reshape(-1), ours.float().reshape(-1)
            rel = float((a - b).norm() / a.norm().clamp_min(1e-30))
            (changed_1d if ours.dim() == 1 else changed).append((name, rel))
        if reshaped:
            self.add(ERROR, "tensors", [r.split(" ")[0].rpartition(".")[0] for r in reshaped],
                     f"{len(reshaped)} unquantized tensor(s) changed shape: {'; '.join(reshaped[:3])}",
                     "the export was made from another model or config")
        if changed:
            self.add(ERROR, "tensors", [n.rpartition(".")[0] for n, _ in changed], f"{len(changed)} unquantized "
                     "tensor(s) differ from the reference: " + ", ".join(f"{n} (relative change {r:.3g})"
                                                                        for n, r in changed[:3]),
                     "the export wrote other values for weights it should keep (a tied copy of the other weight, a "
                     "smoothing scale folded into a weight with no quantized consumer, another model's tensors)")
        if changed_1d:
            self.add(WARNING, "tensors", [n.rpartition(".")[0] for n, _ in changed_1d], f"{len(changed_1d)} "
                     "unquantized 1-D tensor(s) (norms, biases) differ from the reference and no quantized layer's "
                     "scales explain it: " + ", ".join(f"{n} (relative change {r:.3g})" for n, r in changed_1d[:3]),
                     "a pre_quant_scale folded into a norm without the matching change in its consumers, or a norm "
                     "taken from another layer")
        if refolded:
            self.add(INFO, "tensors", [n.rpartition(".")[0] for n in refolded], f"{len(refolded)} norm(s) differ from "
                     "the reference because export folded AWQ pre_quant_scales into them (their consumers' "
                     "dequantized weights match the reference through them)")

    # -------------------------------------------------------------------------------------------- canary
    def check_canary(self, windows: int, tokens: int) -> None:
        import torch

        from quantlab.engines.qlayers import QLAYERS
        from quantlab.engines.torch_engine import load_exported
        from quantlab.gate.metrics import compare_positions
        from quantlab.models import load_model, load_tokenizer

        algos = self.quant.algos()
        unknown = sorted(a for a in algos if a not in QLAYERS)
        if unknown:
            self.skipped.append(f"canary: engine=torch does not run {', '.join(unknown)}")
            return
        start = time.time()
        ids = _canary_ids(load_tokenizer(self.ref), windows, tokens)
        with torch.no_grad():
            reference = load_model(self.ref, self.device, self.dtype)
            ref_logits = reference(ids.to(self.device.torch), use_cache=False).logits.float().cpu()
            del reference  # one model in memory at a time
            try:
                model, _ = load_exported(self.ckpt, self.device, self.dtype)
            except QuantlabError as exc:
                self.add(ERROR, "canary", [], f"the export does not load with deployment numerics: {exc.problem}",
                         "see the tensor findings above; an engine would refuse this checkpoint")
                return
            logits = model(ids.to(self.device.torch), use_cache=False).logits.float().cpu()
            del model
        cmp = compare_positions(ref_logits[:, :-1], logits[:, :-1], ids[:, 1:])
        agree = (cmp["argmax_ref"] == cmp["argmax_cand"]).float()
        finite = bool(torch.isfinite(logits).all())
        kl = cmp["kl"].float()
        top1, kl_mean = float(agree.mean()), float(kl.mean()) if finite else math.inf
        nll_gap = float(cmp["nll_cand"].mean() - cmp["nll_ref"].mean()) if finite else math.inf
        ppl_ratio = math.exp(nll_gap) if nll_gap < 700 else math.inf
        b = canary_bounds(algos)
        self.canary = {"windows": int(ids.shape[0]), "tokens": int(ids.shape[1]), "positions": int(agree.numel()),
                       "top1": top1, "kl_mean": _finite(kl_mean), "kl_p99": _finite(float(kl.quantile(0.99))),
                       "ppl_ratio": _finite(ppl_ratio), "finite": finite, "bounds": asdict(b),
                       "seconds": round(time.time() - start, 2)}
        text = (f"top-1 agreement {top1:.3f}, mean KL {kl_mean:.4f} nats, perplexity ratio {ppl_ratio:.3f} over "
                f"{agree.numel()} positions ({ids.shape[0]} x {ids.shape[1]} tokens)")
        if not finite or top1 < b.top1_error or kl_mean > b.kl_error:
            self.add(ERROR, "canary", [], f"the exported checkpoint's logits diverge from the reference: {text}; "
                     f"healthy {'/'.join(sorted(algos))} exports stay above top-1 {b.top1_error} and below KL "
                     f"{b.kl_error}", "a broken layer the tensor checks cannot see (activation or KV scales that "
                     "saturate, layers in the wrong order) or one they reported above")
        elif top1 < b.top1_warn or kl_mean > b.kl_warn:
            self.add(WARNING, "canary", [], f"the exported checkpoint's logits are further from the reference than "
                     f"healthy exports of its format: {text} (warn below top-1 {b.top1_warn} / over KL {b.kl_warn})",
                     "a format too aggressive for this model, or a partly broken layer: run the evaluation")
        else:
            self.add(INFO, "canary", [], f"logits canary: {text}")


_MISSING_CAUSE = {
    "input_scale": "its input (activation) quantizer was never calibrated (an MoE expert that received no calibration "
                   "tokens, a layer the forward loop never reached): static activation quantization has no scale",
    "weight_scale": "export wrote codes without their scales (a quantizer without amax)",
    "weight_scale_2": "the per-tensor second-level scale was not written: the block scales cannot be dequantized",
    "pre_quant_scale": "the smoothing scale was neither written nor folded into a norm",
}


def _format_label(fmt: LayerFormat | None) -> str:
    """FP8, W4A16_AWQ/64, none."""
    if fmt is None:
        return "none"
    return fmt.quant_algo + (f"/{fmt.group_size}" if fmt.group_size else "")


def _finite(x: float) -> float | None:
    """A figure for the JSON report: None where it is not finite (the report stays strict JSON)."""
    return x if math.isfinite(x) else None


def _kept_high_precision(module: str, head: str | None) -> bool:
    """Modules ModelOpt's recipes never quantize: the output head, MoE routers, vision towers."""
    parts = module.split(".")
    return module == head or parts[-1] in HIGH_PRECISION_NAMES or any("vision" in p or "visual" in p for p in parts)


def _looks_like(t: CheckpointTensors, module: str, dims: tuple, fmt: LayerFormat) -> str | None:
    """The first other registered format whose QLAYERS class reads this layer's tensors without refusal."""
    import torch

    from quantlab.engines.qlayers import QLAYERS, LayerContext

    out_f, in_f, has_bias = dims
    ctx = LayerContext("cpu", False, torch.float32)
    group = _group_guess(t, module, in_f)
    for algo in QLAYERS:
        if algo == fmt.quant_algo:
            continue
        try:
            QLAYERS[algo].from_checkpoint(module, out_f, in_f, has_bias, t, LayerFormat(algo, group), ctx)
        except (QuantlabError, RuntimeError, ValueError, ZeroDivisionError):
            continue
        return algo
    return None


def _group_guess(t: CheckpointTensors, module: str, in_features: int) -> int | None:
    shape = t.shape_of(f"{module}.weight_scale")
    return in_features // shape[1] if shape and len(shape) == 2 and shape[1] and in_features % shape[1] == 0 else None


def _weight_stats(ref, eff) -> dict:
    """cosine, SQNR (dB) and gain (the factor that best maps eff onto ref) of an effective dequantized weight against
    the reference weight. float32 BLAS dot products: their relative error (~1e-6) is far below every bound."""
    import torch

    a, b = ref.reshape(-1).float(), eff.reshape(-1).float()
    d = a - b
    aa, bb, ab, dd = (float(torch.dot(x, y)) for x, y in ((a, a), (b, b), (a, b), (d, d)))
    cosine = ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 else 0.0
    sqnr = 10 * math.log10(aa / dd) if dd > 0 and aa > 0 else (SQNR_CAP if aa > 0 else -SQNR_CAP)
    gain = ab / bb if bb > 0 else GAIN_CAP  # an all-zero dequantized weight: no factor maps it back
    if not all(math.isfinite(x) for x in (cosine, sqnr, gain)):  # NaN / Inf in the weights: nothing matches
        cosine, sqnr, gain = 0.0, -SQNR_CAP, GAIN_CAP
    return {"cosine": round(min(cosine, 1.0), 6), "sqnr_db": round(max(-SQNR_CAP, min(sqnr, SQNR_CAP)), 3),
            "gain": round(max(-GAIN_CAP, min(gain, GAIN_CAP)), 5)}


def _same_file(a: Path, b: Path) -> bool:
    if a.read_bytes() == b.read_bytes():
        return True
    if a.suffix == ".json":  # formatting and key order do not matter
        try:
            return json.loads(a.read_text(encoding="utf-8")) == json.loads(b.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return False
    return False


TOKENIZER_SAMPLE = ("The quick brown fox jumps over the lazy dog. def f(x):\n\treturn x ** 2  # 42\n"
                    "Ünïcödé, 数字 123, emoji \U0001F600, trailing spaces   \n\n")


def _tokenizer_changes(ref_dir: Path, ckpt: Path) -> list[str]:
    """How the export's tokenizer tokenizes differently from the reference's (empty: identically)."""
    from quantlab.models import check_tokenizer

    try:
        ours = check_tokenizer(ckpt)
    except QuantlabError as exc:
        return [f"it does not load ({exc.problem})"]
    theirs = check_tokenizer(ref_dir)
    changes = []
    a, b = theirs.get_vocab(), ours.get_vocab()
    if a != b:
        moved = sum(1 for k in a.keys() & b.keys() if a[k] != b[k])
        changes.append(f"vocabulary ({len(a)} -> {len(b)} entries, {moved} with another id, "
                       f"{len(a.keys() ^ b.keys())} added or removed)")
    special = {k: (getattr(theirs, k, None), getattr(ours, k, None)) for k in
               ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    changed = {k: v for k, v in special.items() if v[0] != v[1]}
    if changed:
        changes.append("special tokens (" + ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in changed.items()) + ")")
    sample = TOKENIZER_SAMPLE + "".join(str(t) for t in theirs.all_special_tokens)
    if theirs(sample)["input_ids"] != ours(sample)["input_ids"]:
        changes.append("the ids of a sample text")
    return changes


def _chat_template(directory: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = _read_json(directory / "tokenizer_config.json", "tokenizer config") or {}
    template = cfg.get("chat_template")
    return json.dumps(template, sort_keys=True) if isinstance(template, (list, dict)) else template


def _canary_ids(tokenizer, windows: int, tokens: int):
    """windows x tokens ids of Python's own documentation (pydoc_data.topics, always offline), the topics taken from
    the end of the sorted list (calibration recipes and the test models' training start at the beginning)."""
    from pydoc_data.topics import topics

    import torch

    names = sorted(topics)[::-1]
    text, want = "", windows * tokens * 16  # characters: more than enough at any tokenizer's chars per token
    for name in names:
        if len(text) >= want:
            break
        text += topics[name].strip() + "\n\n"
    ids = tokenizer(text[:want])["input_ids"]
    per = min(tokens, len(ids) // windows)
    if per < 2:
        raise QuantlabError("the reference tokenizer gives too few tokens for the canary",
                            fix="check the reference's tokenizer, or run with --no-canary")
    return torch.tensor(ids[: windows * per]).view(windows, per)


def _reference(reference) -> Any:
    """A ModelRef for the reference: given, or built from a directory with prepare's checks (a causal LM,
    unquantized, safetensors matching config.json, a tokenizer that loads)."""
    from quantlab.models import ModelRef

    if reference is None or isinstance(reference, ModelRef):
        return reference
    path = Path(reference).expanduser()
    if not path.exists():
        raise QuantlabError(f"reference {path} does not exist",
                            fix="pass --reference the directory of the unquantized HF model the export was made from")
    return ModelRef.from_path(path)


# ------------------------------------------------------------------------------------------- entry points
def open_checkpoint(checkpoint: str | Path) -> tuple[Path, QuantConfig, dict, CheckpointTensors]:
    """(directory, hf_quant_config.json, config.json, tensors) of an export, or QuantlabError naming what makes it
    unusable: no such directory, no hf_quant_config.json or config.json, damaged JSON or safetensors headers.
    Nothing heavy is imported: bad input is refused in well under a second."""
    ckpt = Path(checkpoint).expanduser()
    if not ckpt.is_dir():
        raise QuantlabError(f"checkpoint {ckpt} is not a directory" if ckpt.exists() else
                            f"checkpoint {ckpt} does not exist",
                            fix="pass the directory export_hf_checkpoint() wrote (hf_quant_config.json + safetensors)")
    quant = read_quant_config(ckpt, required=True)
    config = _read_json(ckpt / "config.json", "config")
    if config is None:
        raise QuantlabError(f"{ckpt} has no config.json, so no engine can build its model",
                            fix="point at the directory export_hf_checkpoint() wrote (it writes config.json)")
    return ckpt, quant, config, CheckpointTensors(ckpt)


def audit(checkpoint: str | Path, reference=None, canary: bool = True, *, canary_windows: int = 2,
          canary_tokens: int = 128, device=None, dtype=None) -> AuditReport:
    """Audit an exported checkpoint (a directory with hf_quant_config.json, config.json and safetensors) against
    its unquantized reference (a directory or a quantlab ModelRef; None skips the checks that need it). The
    canary (needs the reference) runs on `device` (default: cuda if present, else cpu) in `dtype` (default: the
    device's: float32 on CPU; `device` may be a quantlab Device or a spec such as "cpu"). Raises QuantlabError when
    the input cannot be audited at all."""
    from quantlab.env import resolve_device, resolve_dtype

    start = time.time()
    if canary_windows < 1 or canary_tokens < 2:
        raise QuantlabError(f"a canary of {canary_windows} window(s) x {canary_tokens} token(s) is empty",
                            fix="use at least 1 window of 2 tokens, or turn the canary off")
    ckpt, quant, config, tensors = open_checkpoint(checkpoint)
    ref = _reference(reference)
    device = resolve_device(device or "auto") if device is None or isinstance(device, str) else device
    dtype = dtype or resolve_dtype("auto", device)
    timings: dict[str, float] = {"setup": 0.0}
    run = _Audit(ckpt, quant, config, tensors, ref, device, dtype)
    timings["setup"] = round(time.time() - start, 3)
    steps = [("metadata", run.check_metadata), ("coverage", run.check_coverage), ("scales", run.check_scales),
             ("kv_cache", run.check_kv_cache), ("format_weights", run.check_layers), ("tensors", run.check_tensors)]
    if canary and ref is not None:
        steps.append(("canary", lambda: run.check_canary(canary_windows, canary_tokens)))
    elif canary:
        run.skipped.append("canary: needs the reference model (--reference)")
    else:
        run.skipped.append("canary: turned off")
    for name, fn in steps:
        t0 = time.time()
        fn()
        timings[name] = round(time.time() - t0, 3)
    if ref is None:
        run.add(INFO, "weights", [], "no reference model given: dequantized weights, dropped tensors against the "
                "reference, tokenizer / config changes and the logits canary were not checked",
                "pass --reference MODEL_DIR (the unquantized model the export was made from) to check them")
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings = sorted(run.findings, key=lambda f: (order[f.severity], CHECKS.index(f.check)))
    timings["total"] = round(time.time() - start, 3)
    return AuditReport(str(ckpt), str(ref.path) if ref else None, quant.quant_algo, quant.kv_cache_quant_algo,
                       findings, timings, run.layers, run.canary, run.skipped)


def main(argv: list[str] | None = None) -> int:
    """`python -m quantlab.audit CHECKPOINT [--reference MODEL_DIR] [--no-canary] [--json OUT]`: exit 0 without an
    error finding, 1 with one, 2 when the input cannot be audited, 130 when interrupted."""
    parser = argparse.ArgumentParser(
        prog="python -m quantlab.audit",
        description="Catch broken quantized exports in seconds: coverage, scales, dequantized weights vs the "
                    "reference, dropped tensors, metadata and a short logits canary.")
    parser.add_argument("checkpoint", help="the exported checkpoint directory (hf_quant_config.json + safetensors)")
    parser.add_argument("--reference", metavar="MODEL_DIR", help="the unquantized HF model the export was made from")
    parser.add_argument("--no-canary", action="store_true", help="skip the logits canary (tensor checks only)")
    parser.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    parser.add_argument("--device", default="auto", help="device of the canary: auto (default), cpu, cuda, cuda:N")
    parser.add_argument("--canary-windows", type=int, default=2, metavar="N", help="canary windows (default 2)")
    parser.add_argument("--canary-tokens", type=int, default=128, metavar="N", help="tokens per window (default 128)")
    parser.add_argument("--quiet", action="store_true", help="print errors and warnings only")
    args = parser.parse_args(argv)
    return cli_guard(_main, args, interrupted="\nquantlab audit: interrupted",
                     traceback_file="quantlab-audit-traceback.txt")


def _main(args) -> int:
    import warnings

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore")
    open_checkpoint(args.checkpoint)  # unusable input is refused before torch and transformers are imported
    if args.reference and not Path(args.reference).expanduser().exists():
        _reference(args.reference)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    report = audit(args.checkpoint, args.reference, canary=not args.no_canary, canary_windows=args.canary_windows,
                   canary_tokens=args.canary_tokens, device=args.device)
    if args.json:
        out = Path(args.json).expanduser()
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n", encoding="utf-8")
        except OSError as exc:
            raise QuantlabError(f"cannot write the report to {out}: {exc.strerror or exc}",
                                fix="pass --json a path in a writable directory") from None
    print(report.render(show_info=not args.quiet))
    return EXIT_GATE_FAILED if report.errors else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
