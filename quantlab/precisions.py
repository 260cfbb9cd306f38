"""Precision registry: each precision's config schema beside the facts about it (ModelOpt preset, the quant_algo its
export carries, the GPU its GEMMs need, how its weights are counted in bits).

Adding a precision is one schema + one `PRECISIONS.add(...)` here and one YAML in conf/precision/ (plus one class in
engines/qlayers.py if engine=torch should run it). Stages look the entry up by the config's type, never by name.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from quantlab.config import KvCacheConfig, PrecisionConfig
from quantlab.errors import QuantlabError
from quantlab.registry import Registry

BLOCK_CHOICES = (128, 64, 32)  # block_size=auto: the largest of these dividing every quantized input width


# ---------------------------------------------------------------------------------------------- schemas
@dataclass
class Fp8Config(PrecisionConfig):
    """W8A8 FP8 E4M3, per-tensor static scales (Hopper / Ada or newer for real FP8 GEMMs)."""


@dataclass
class Fp8PcPtConfig(PrecisionConfig):
    """W8A8 FP8 E4M3 with per-output-channel weight scales and dynamic per-token activation scales."""


@dataclass
class Int8SqConfig(PrecisionConfig):
    """W8A8 INT8 SmoothQuant: per-channel weights, per-tensor static activations."""

    alpha: Optional[float] = None  # SmoothQuant migration strength; null = ModelOpt's default (0.5)


@dataclass
class Int4AwqConfig(PrecisionConfig):
    """W4A16 AWQ with group-wise int4 weights."""

    block_size: str = "auto"  # auto = the largest of 128 / 64 / 32 dividing every quantized input width


@dataclass
class W4A8AwqConfig(Int4AwqConfig):
    """W4A8 AWQ: int4 weights, FP8 activations (Ada / Hopper or newer)."""


@dataclass
class MixedConfig(PrecisionConfig):
    """Per-layer formats (MIXED_PRECISION), as `+search=cheapest` exports them. quantlab evaluates such a checkpoint
    (engine.checkpoint=...); it makes one only through the search."""


@dataclass
class ExternalConfig(PrecisionConfig):
    """A checkpoint made by any tool quantlab reads (quantlab.formats: ModelOpt, compressed-tensors, GPTQ / AWQ,
    GGUF): its format and KV cache are read from its files, never calibrated here (engine.checkpoint=...)."""


@dataclass
class Nvfp4Config(PrecisionConfig):
    """NVFP4 W4A4: E2M1 values in blocks of 16 with FP8 block scales and a per-tensor scale (Blackwell or newer)."""


# ---------------------------------------------------------------------------------------------- audit bounds
@dataclass(frozen=True)
class WeightBounds:
    """Per-layer bounds of a format, dequantized weight vs reference (quantlab.audit.weights): an error below
    cosine_error or sqnr_error_db, a warning below sqnr_warn_db; an error when the per-input-channel factors that map
    the dequantized weight onto the reference spread more than column_spread_error (robust standard deviation of
    their logarithm: a smoothing scale missing or misapplied), a warning over column_spread_warn."""

    cosine_error: float
    sqnr_error_db: float
    sqnr_warn_db: float
    column_spread_error: float = 0.1
    column_spread_warn: float = 0.05


@dataclass(frozen=True)
class CanaryBounds:
    """Logits-canary bounds of a format (quantlab.audit.canary): an error when top-1 agreement falls below
    top1_error or the mean KL rises over kl_error, a warning below top1_warn / over kl_warn."""

    top1_error: float
    top1_warn: float
    kl_error: float
    kl_warn: float


@dataclass(frozen=True)
class ScaleBounds:
    """Bounds of a static activation (or KV cache) scale against the activations it quantizes (quantlab.audit.
    activations), on the reference's activations over held-out text. Clipping (the text reaches past scale x qmax):
    the SQNR lost against the best static scale for that text (max |x| / qmax), an error over clip_error_db in any
    one layer, a warning over clip_warn_db, and an error when the export's median layer loses over
    clip_median_error_db (a mistake every layer shares: units, a calibration that failed everywhere; formats that
    smooth their inputs see single layers of barely trained models clip far more than their median). Wasted range
    (the scale reaches past the text): max |x| / (scale x qmax), an error under waste_ratio_error, a warning under
    waste_ratio_warn (a ratio, since FP8's exponents hide a scale many times too large from an energy measure while
    its small values sink into the subnormals; a short text shows less than the calibration's max, so healthy
    ratios sit below 1). qmax: the largest code value the scale maps amax to (448 for E4M3, 127 for INT8, 6 x 448
    for NVFP4's global scale). A single layer's clipping is an error only when, beside its SQNR loss, the text
    reaches clip_ratio_error times past the scale: a layer calibrated on a handful of tokens misses the heaviest
    outliers of its (heavy-tailed) input by up to 1.5x in healthy exports, which can cost 13 dB on a down_proj, while
    a scale of the wrong layer or unit is off by a larger factor."""

    qmax: float
    clip_error_db: float
    clip_warn_db: float
    clip_median_error_db: float
    waste_ratio_error: float
    waste_ratio_warn: float
    clip_ratio_error: float = 3.0


@dataclass(frozen=True)
class AuditBounds:
    """What the checkpoint audit holds an export of a precision to. Every precision states its own (a required
    field of its registry entry); healthy values and how the bounds were set: docs/audit.md, bench/RESULTS.md.
    activations: None for formats without static activation scales (weight-only, dynamic per-token)."""

    weights: WeightBounds
    canary: CanaryBounds
    activations: ScaleBounds | None = None


# Bounds from the healthy exports measured by bench/audit_healthy.py (docs/audit.md, bench/RESULTS.md: every
# statistic's distribution, the cells, the false alarms). Margins: SQNR and activation loss bounds sit at least 6 dB
# (a factor 4 in error energy) beyond the worst healthy value, cosine bounds at 4x the worst healthy 1 - cosine,
# column-spread bounds at 1.5x the worst healthy spread, canary KL at 3x the worst healthy KL.
_W8 = WeightBounds(cosine_error=0.998, sqnr_error_db=25.0, sqnr_warn_db=28.0, column_spread_error=0.05,
                   column_spread_warn=0.03)
_W8_SQ = WeightBounds(cosine_error=0.993, sqnr_error_db=18.0, sqnr_warn_db=21.0, column_spread_error=0.12,
                      column_spread_warn=0.09)
_W4 = WeightBounds(cosine_error=0.945, sqnr_error_db=9.5, sqnr_warn_db=12.5, column_spread_error=0.16,
                   column_spread_warn=0.12)
_W_NVFP4 = WeightBounds(cosine_error=0.98, sqnr_error_db=14.0, sqnr_warn_db=17.0, column_spread_error=0.06,
                        column_spread_warn=0.045)
_C8 = CanaryBounds(top1_error=0.7, top1_warn=0.8, kl_error=0.15, kl_warn=0.08)
_C8_SQ = CanaryBounds(top1_error=0.6, top1_warn=0.75, kl_error=0.45, kl_warn=0.25)
_C4 = CanaryBounds(top1_error=0.55, top1_warn=0.7, kl_error=0.8, kl_warn=0.35)
_A_FP8 = ScaleBounds(qmax=448.0, clip_error_db=10.0, clip_warn_db=6.0, clip_median_error_db=3.0,
                     waste_ratio_error=1 / 32, waste_ratio_warn=1 / 16)
_A_INT8 = ScaleBounds(qmax=127.0, clip_error_db=40.0, clip_warn_db=16.0, clip_median_error_db=20.0,
                      waste_ratio_error=1 / 8, waste_ratio_warn=1 / 5)
_A_W4A8 = ScaleBounds(qmax=448.0, clip_error_db=40.0, clip_warn_db=10.0, clip_median_error_db=3.0,
                      waste_ratio_error=1 / 32, waste_ratio_warn=1 / 16)
_A_NVFP4 = ScaleBounds(qmax=6 * 448.0, clip_error_db=6.0, clip_warn_db=3.0, clip_median_error_db=3.0,
                       waste_ratio_error=1 / 32, waste_ratio_warn=1 / 16)
_KV_FP8 = ScaleBounds(qmax=448.0, clip_error_db=6.0, clip_warn_db=3.0, clip_median_error_db=3.0,
                      waste_ratio_error=1 / 32, waste_ratio_warn=1 / 16)


# ---------------------------------------------------------------------------------------------- entries
@dataclass(frozen=True)
class Precision:
    """What a precision is. `weight_bits` and `scale_bits_per_weight` give its effective bits per weight (the
    search's cost): the stored value width plus its scales spread over the weights they cover."""

    name: str
    schema: type
    modelopt_cfg: str  # ModelOpt preset in modelopt.torch.quantization
    quant_algo: str  # hf_quant_config.json quant_algo its export carries
    min_capability: tuple[int, int] | None  # CUDA compute capability its GEMMs need (None: any)
    gpu_generation: str
    weight_bits: int
    blockwise: bool = False  # int4 weights in groups of block_size along the input dimension
    fixed_block: int | None = None  # a block size the format fixes (NVFP4: 16)
    scale_bits: int = 0  # bits of one weight scale (per tensor, per channel or per block)
    adjust: Callable[[dict, Any], None] | None = field(default=None, compare=False)  # edit the ModelOpt config
    # what the audit holds its exports to (None only for `mixed`: each layer is held to its own format's bounds)
    audit: AuditBounds | None = field(kw_only=True)


def _smoothquant_alpha(cfg: dict, precision: Int8SqConfig) -> None:
    if precision.alpha is not None:
        cfg["algorithm"] = {"method": "smoothquant", "alpha": float(precision.alpha)}


PRECISIONS: Registry[Precision] = Registry("precision", "+precision=NAME")
PRECISIONS.add("fp8", Precision("fp8", Fp8Config, "FP8_DEFAULT_CFG", "FP8", (8, 9), "Ada / Hopper or newer", 8,
                                audit=AuditBounds(_W8, _C8, _A_FP8)))
PRECISIONS.add("fp8_pc_pt", Precision("fp8_pc_pt", Fp8PcPtConfig, "FP8_PER_CHANNEL_PER_TOKEN_CFG",
                                      "FP8_PER_CHANNEL_PER_TOKEN", (8, 9), "Ada / Hopper or newer", 8, scale_bits=32,
                                      audit=AuditBounds(_W8, _C8)))
PRECISIONS.add("int8_sq", Precision("int8_sq", Int8SqConfig, "INT8_SMOOTHQUANT_CFG", "W8A8_SQ_PER_CHANNEL", None,
                                    "any", 8, scale_bits=32, adjust=_smoothquant_alpha,
                                    audit=AuditBounds(_W8_SQ, _C8_SQ, _A_INT8)))
PRECISIONS.add("int4_awq", Precision("int4_awq", Int4AwqConfig, "INT4_AWQ_CFG", "W4A16_AWQ", None, "any", 4,
                                     blockwise=True, scale_bits=16, audit=AuditBounds(_W4, _C4)))
PRECISIONS.add("w4a8_awq", Precision("w4a8_awq", W4A8AwqConfig, "W4A8_AWQ_BETA_CFG", "W4A8_AWQ", (8, 9),
                                     "Ada / Hopper or newer", 4, blockwise=True, scale_bits=16,
                                     audit=AuditBounds(_W4, _C4, _A_W4A8)))
PRECISIONS.add("nvfp4", Precision("nvfp4", Nvfp4Config, "NVFP4_DEFAULT_CFG", "NVFP4", (10, 0), "Blackwell or newer",
                                  4, fixed_block=16, scale_bits=8, audit=AuditBounds(_W_NVFP4, _C4, _A_NVFP4)))

PRECISIONS.add("mixed", Precision("mixed", MixedConfig, "", "MIXED_PRECISION", None, "per layer", 8,
                                  audit=None))
# precision=external: the checkpoint's own files say its format (each layer class states its audit bounds)
PRECISIONS.add("external", Precision("external", ExternalConfig, "", "EXTERNAL", None, "per checkpoint", 8,
                                     audit=None))

PRECISION_SCHEMAS: dict[str, type] = {name: p.schema for name, p in PRECISIONS.items()}


def precision_of(cfg: PrecisionConfig) -> Precision:
    """The registry entry of a precision config, found by its type (exact type: subclasses are entries too)."""
    entry = PRECISIONS.find(lambda p: p.schema is type(cfg))
    if entry is None:
        raise QuantlabError(f"{type(cfg).__name__} is not a registered precision",
                            fix=f"choose +precision= one of {', '.join(PRECISIONS)}")
    return entry


def precision_by_algo(quant_algo: str) -> Precision | None:
    """The precision whose export carries this quant_algo, or None."""
    return PRECISIONS.find(lambda p: p.quant_algo == quant_algo)


# --------------------------------------------------------------------------------------------- KV cache
@dataclass(frozen=True)
class KvFormat:
    """A KV cache format: the ModelOpt preset that quantizes the cache (None: not quantized), the
    kv_cache_quant_algo its export carries, the compute capability it needs, its bits per value and the bounds the
    audit holds its k_scale / v_scale to (None: not quantized)."""

    name: str
    modelopt_cfg: str | None
    quant_algo: str | None  # hf_quant_config.json kv_cache_quant_algo
    min_capability: tuple[int, int] | None
    bits: int
    audit: ScaleBounds | None = None


KV_FORMATS: Registry[KvFormat] = Registry("kv cache format", "kv_cache=NAME")
KV_FORMATS.add("none", KvFormat("none", None, None, None, 16))
KV_FORMATS.add("fp8", KvFormat("fp8", "FP8_KV_CFG", "FP8", (8, 9), 8, audit=_KV_FP8))


def kv_format(kv: KvCacheConfig) -> KvFormat:
    """The registry entry of a kv_cache config, by kv_cache.dtype (an unknown one is exit 2)."""
    return KV_FORMATS.get(kv.dtype)


# ----------------------------------------------------------------------------------------- block sizes
def parse_block_size(precision: PrecisionConfig) -> int | None:
    """The explicit block size of a blockwise precision, None for auto (or a format without one)."""
    raw = getattr(precision, "block_size", None)
    if raw is None or str(raw) == "auto":
        return None
    text = str(raw).strip()
    if not text.isdigit() or int(text) <= 0:
        raise QuantlabError(f"precision.block_size={raw!r} is neither auto nor a positive integer",
                            fix="use precision.block_size=auto (the default) or e.g. 64")
    return int(text)


def resolve_block_size(precision: PrecisionConfig, in_dims: dict[str, int]) -> tuple[int | None, str]:
    """(block size, how it was chosen) for a precision on a model whose quantized Linears have these input widths
    (short layer name -> width). Explicit sizes must divide every width (exit 2 with the sizes that would)."""
    entry = precision_of(precision)
    if entry.fixed_block:
        return entry.fixed_block, f"fixed by {entry.name}"
    if not entry.blockwise:
        return None, "not blockwise"
    fitting = [b for b in BLOCK_CHOICES if all(d % b == 0 for d in in_dims.values())]
    explicit = parse_block_size(precision)
    if explicit is None:
        if not fitting:
            where = ", ".join(f"{n} in={d}" for n, d in sorted(in_dims.items()))
            raise QuantlabError(f"no AWQ block size of {', '.join(map(str, BLOCK_CHOICES))} divides every quantized "
                                f"input width ({where})", fix="set precision.block_size to a divisor of every width")
        return fitting[0], (f"auto: the largest of {'/'.join(map(str, BLOCK_CHOICES))} dividing every quantized "
                            "input width")
    bad = {n: d for n, d in in_dims.items() if d % explicit}
    if bad:
        where = ", ".join(f"{n} in={d}" for n, d in sorted(bad.items()))
        fix = (f"use precision.block_size={fitting[0]} (or auto)" if fitting
               else "use precision.block_size=auto or a divisor of every width")
        raise QuantlabError(f"AWQ block size {explicit} does not divide the input dimension of quantized layers "
                            f"({where})", fix=fix)
    return explicit, "explicit"


# ------------------------------------------------------------------------------------------ ModelOpt
def describe(precision: PrecisionConfig, kv: KvCacheConfig, block_size: int | None) -> dict:
    """What identifies the quantization recipe (part of every downstream cache key)."""
    fields = asdict(precision)
    if "block_size" in fields:  # the request as earlier versions keyed it: null for auto
        fields["block_size"] = parse_block_size(precision)
    return {"precision": {"name": precision_of(precision).name, **fields}, "kv_cache": kv.dtype,
            "block_size": block_size}


def modelopt_config(precision: PrecisionConfig, kv: KvCacheConfig, block_size: int | None) -> dict:
    """The ModelOpt quantize config: the preset, its block size set, the KV cache entries appended."""
    import modelopt.torch.quantization as mtq

    entry = precision_of(precision)
    cfg = copy.deepcopy(getattr(mtq, entry.modelopt_cfg))
    if entry.blockwise:
        for item in cfg["quant_cfg"]:
            if item.get("quantizer_name") == "*weight_quantizer":
                sub = item["cfg"]
                for one in (sub if isinstance(sub, list) else [sub]):
                    if one.get("block_sizes"):
                        one["block_sizes"][-1] = block_size
    if entry.adjust is not None:
        entry.adjust(cfg, precision)
    kv_entry = kv_format(kv)
    if kv_entry.modelopt_cfg:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(getattr(mtq, kv_entry.modelopt_cfg)["quant_cfg"])
    # ModelOpt gives every nn.LayerNorm an input quantizer (for FP8 attention fusion) that the export never ships
    # (OPT, GPT-NeoX): the fake-quant model must quantize exactly what the checkpoint carries.
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [{"quantizer_name": "*", "parent_class": "nn.LayerNorm",
                                                  "enable": False}]
    return cfg
