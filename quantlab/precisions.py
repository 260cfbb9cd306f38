"""Precision registry: config type -> how ModelOpt quantizes it and what the export must say.

One entry per precision; stages look the entry up by the config's type instead of branching on names.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from quantlab.config import (Fp8Config, Int4AwqConfig, Int8SqConfig, KvCacheConfig, Nvfp4Config, PrecisionConfig,
                             W4A8AwqConfig)
from quantlab.errors import QuantlabError


@dataclass(frozen=True)
class PrecisionSpec:
    modelopt_cfg: str  # name of the ModelOpt preset in modelopt.torch.quantization
    quant_algo: str  # hf_quant_config.json "quant_algo" the export must carry
    min_capability: tuple[int, int] | None  # CUDA compute capability its GEMMs need (None: any)
    gpu_generation: str
    blockwise: bool = False  # int4 weights in groups of block_size along the input dimension


REGISTRY: dict[type, PrecisionSpec] = {
    Fp8Config: PrecisionSpec("FP8_DEFAULT_CFG", "FP8", (8, 9), "Ada / Hopper or newer"),
    Int8SqConfig: PrecisionSpec("INT8_SMOOTHQUANT_CFG", "W8A8_SQ_PER_CHANNEL", None, "any"),
    Int4AwqConfig: PrecisionSpec("INT4_AWQ_CFG", "W4A16_AWQ", None, "any", blockwise=True),
    W4A8AwqConfig: PrecisionSpec("W4A8_AWQ_BETA_CFG", "W4A8_AWQ", (8, 9), "Ada / Hopper or newer", blockwise=True),
    Nvfp4Config: PrecisionSpec("NVFP4_DEFAULT_CFG", "NVFP4", (10, 0), "Blackwell or newer"),
}

KV_CACHE = {"none": None, "fp8": ("FP8_KV_CFG", "FP8")}
DEFAULT_AWQ_BLOCK = 128


def spec_for(precision: PrecisionConfig) -> PrecisionSpec:
    return REGISTRY[type(precision)]


def kv_quant_algo(kv: KvCacheConfig) -> str | None:
    if kv.dtype not in KV_CACHE:
        raise QuantlabError(f"kv_cache.dtype={kv.dtype!r} is not supported", fix=f"use one of {sorted(KV_CACHE)}")
    entry = KV_CACHE[kv.dtype]
    return entry and entry[1]


def effective_block_size(precision: PrecisionConfig, preferred: int | None) -> int | None:
    if not spec_for(precision).blockwise:
        return None
    return precision.block_size or preferred or DEFAULT_AWQ_BLOCK


def describe(precision: PrecisionConfig, kv: KvCacheConfig, block_size: int | None) -> dict:
    """What identifies the quantization recipe (part of every downstream cache key)."""
    from dataclasses import asdict

    return {"precision": asdict(precision), "kv_cache": kv.dtype, "block_size": block_size}


def modelopt_config(precision: PrecisionConfig, kv: KvCacheConfig, block_size: int | None) -> dict:
    import modelopt.torch.quantization as mtq

    spec = spec_for(precision)
    cfg = copy.deepcopy(getattr(mtq, spec.modelopt_cfg))
    if spec.blockwise:
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer":
                sub = entry["cfg"]
                for one in (sub if isinstance(sub, list) else [sub]):
                    if one.get("block_sizes"):
                        one["block_sizes"][-1] = block_size
    if isinstance(precision, Int8SqConfig) and precision.alpha is not None:
        cfg["algorithm"] = {"method": "smoothquant", "alpha": float(precision.alpha)}
    kv_entry = KV_CACHE[kv.dtype]
    if kv_entry:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(getattr(mtq, kv_entry[0])["quant_cfg"])
    return cfg
