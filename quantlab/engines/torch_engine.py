"""engine=torch: the exported checkpoint executed with deployment numerics.

Reads only what ships (hf_quant_config.json + safetensors): an HF skeleton from config.json, every quantized
Linear replaced by a layer from quantlab.engines.qlayers, FP8 KV cache applied where attention reads K/V
(after RoPE, as the cache stores them). Missing scales, wrong dtypes or shapes are reported by tensor name.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from quantlab.config import DEVICE_MAPS
from quantlab.engines.base import Engine, Limits
from quantlab.engines.qlayers import Fp8Linear, Int4AwqLinear, Int8SqLinear, fp8_qdq, fuse_shared_inputs
from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")
SUPPORTED = ("FP8", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ")
ATTN_NAME = "quantlab_fp8_kv"


class CheckpointTensors:
    """Lazy access to every tensor of a checkpoint, with errors that name the tensor."""

    def __init__(self, ckpt: Path):
        from quantlab.stages.prepare import read_safetensors_header, tensor_index

        self.ckpt = ckpt
        files = sorted(ckpt.glob("*.safetensors"))
        if not files:
            raise QuantlabError(f"checkpoint {ckpt} has no safetensors files")
        for f in files:
            read_safetensors_header(f)  # truncation / corruption, before any tensor is read
        self.where = tensor_index(ckpt)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple | None = None) -> torch.Tensor:
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

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, fp8_qdq(key, module.quantlab_k_scale),
                                  fp8_qdq(value, module.quantlab_v_scale), attention_mask, **kwargs)


def _quant_layer(name: str, lin: nn.Linear, t: CheckpointTensors, algo: str, block: int | None, native_fp8: bool,
                 compute_dtype: torch.dtype, device) -> nn.Module:
    n, k = lin.out_features, lin.in_features
    bias = t.get(f"{name}.bias", shape=(n,)).float() if lin.bias is not None else None
    if algo == "FP8":
        layer = Fp8Linear(t.get(f"{name}.weight", torch.float8_e4m3fn, (n, k)), t.get(f"{name}.weight_scale", shape=()),
                          t.get(f"{name}.input_scale", shape=()), bias, native_fp8)
    elif algo == "W8A8_SQ_PER_CHANNEL":
        layer = Int8SqLinear(t.get(f"{name}.weight", torch.int8, (n, k)), t.get(f"{name}.weight_scale", shape=(n,)),
                             t.get(f"{name}.input_scale", shape=()), t.get(f"{name}.pre_quant_scale", shape=(k,)), bias)
    else:
        pqs = t.optional(f"{name}.pre_quant_scale")
        if pqs is not None and tuple(pqs.shape) != (k,):
            raise QuantlabError(f"tensor {name}.pre_quant_scale has shape {list(pqs.shape)}, expected [{k}]")
        layer = Int4AwqLinear(t.get(f"{name}.weight", torch.uint8, (n // 2, k)),
                              t.get(f"{name}.weight_scale", shape=(n, k // block)), block, pqs, bias, compute_dtype)
    for scale in ("weight_scale", "input_scale"):
        value = getattr(layer, scale, None)
        if value is not None and (not torch.isfinite(value).all() or (value <= 0).any()):
            raise QuantlabError(f"tensor {name}.{scale} holds non-positive or non-finite values",
                                fix="re-export the checkpoint; calibration did not produce usable scales")
    return layer.to(device)


def _placement(model: nn.Module, device, dtype: torch.dtype, device_map: str | None):
    """(module name -> torch device, accelerate device map or None). One device unless model.device_map asks
    accelerate to spread the decoder layers over every visible GPU (sizes estimated from the unquantized
    skeleton, so the plan errs on the roomy side)."""
    if not device_map:
        return (lambda name: device.torch), None
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if device_map not in DEVICE_MAPS:
        raise QuantlabError(f"model.device_map={device_map!r} is not supported by engine=torch",
                            fix=f"use one of {', '.join(DEVICE_MAPS)}")
    no_split = getattr(model, "_no_split_modules", None) or []
    max_memory = None if device_map == "sequential" else get_balanced_memory(
        model, dtype=dtype, no_split_module_classes=no_split, low_zero=device_map == "balanced_low_0")
    dmap = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)

    def where(name: str) -> str:
        best = max((k for k in dmap if k == "" or name == k or name.startswith(k + ".")), key=len, default=None)
        placed = dmap[best] if best is not None else device.torch
        return f"cuda:{placed}" if isinstance(placed, int) else str(placed)

    return where, dmap


def load_exported(ckpt: Path, device, dtype: torch.dtype, device_map: str | None = None) -> tuple[nn.Module, dict]:
    """The exported checkpoint as a runnable model, and a plan saying which kernel runs each layer."""
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    quant = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    if algo not in SUPPORTED:
        raise QuantlabError(f"engine=torch runs {', '.join(SUPPORTED)}; this checkpoint is {algo}",
                            fix="use engine=fakequant (simulation) or engine=trtllm for this format")
    block = quant.get("group_size")
    config = AutoConfig.from_pretrained(ckpt)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we build the quantized layers ourselves
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    t = CheckpointTensors(ckpt)
    where, dmap = _placement(model, device, dtype, device_map)
    native_fp8 = device.type == "cuda" and device.has_fp8
    excluded = set(quant.get("exclude_modules") or [])
    replaced = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name in excluded:
            continue
        if f"{name}.weight_scale" not in t:
            if f"{name}.weight" in t and t.where[f"{name}.weight"].get_slice(f"{name}.weight").get_dtype() in ("F8_E4M3", "I8", "U8"):
                t.get(f"{name}.weight_scale")  # a quantized weight without its scale: report the missing tensor
            continue
        parent_name, _, child = name.rpartition(".")
        target = where(name)
        setattr(model.get_submodule(parent_name), child,
                _quant_layer(name, module, t, algo, block, native_fp8 and target.startswith("cuda"), dtype, target))
        replaced[name] = algo
    if not replaced:
        raise QuantlabError(f"checkpoint {ckpt} says {algo} but no layer has a weight_scale tensor",
                            fix="re-export the checkpoint")
    # Everything else (embeddings, norms, lm_head, unquantized layers) is plain high-precision weights.
    state = {}
    for key, param in list(model.named_parameters()) + list(model.named_buffers()):
        if param.device.type != "meta":
            continue
        if key in t:
            state[key] = t.get(key, shape=tuple(param.shape)).to(device=where(key),
                                                                   dtype=dtype if param.is_floating_point() else param.dtype)
        elif not (key == "lm_head.weight" and config.tie_word_embeddings) and "rotary_emb" not in key:
            raise QuantlabError(f"exported checkpoint {ckpt} is missing tensor {key}", fix="re-export the checkpoint")
    model.load_state_dict(state, strict=False, assign=True)  # replaces the meta tensors; quantized layers untouched
    for name, mod in list(model.named_modules()):  # RoPE buffers are computed at init: rebuild them for real
        if type(mod).__name__.endswith("RotaryEmbedding") and hasattr(mod, "config"):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, type(mod)(mod.config, device=where(name)))
    if config.tie_word_embeddings:
        model.tie_weights()
    leftover = [k for k, v in list(model.named_parameters()) + list(model.named_buffers()) if v.device.type == "meta"]
    if leftover:
        raise QuantlabError(f"exported checkpoint {ckpt} does not provide {', '.join(leftover[:5])}",
                            fix="re-export the checkpoint")
    kv = None
    if kv_algo == "FP8":
        AttentionInterface.register(ATTN_NAME, _fp8_kv_attention)
        for name, module in model.named_modules():
            if hasattr(module, "k_proj") and hasattr(module, "v_proj"):
                ks = t.get(f"{name}.k_proj.k_scale", shape=()).float().to(where(name))
                vs = t.get(f"{name}.v_proj.v_scale", shape=()).float().to(where(name))
                if not (ks > 0 and vs > 0):
                    raise QuantlabError(f"{name}: k_scale / v_scale must be positive (got {float(ks)}, {float(vs)})")
                module.quantlab_k_scale, module.quantlab_v_scale = ks, vs
        model.set_attn_implementation(ATTN_NAME)
        kv = "fp8 (k_scale / v_scale per layer, applied after RoPE)"
    elif kv_algo is not None:
        raise QuantlabError(f"engine=torch does not run kv_cache_quant_algo={kv_algo}")
    # q/k/v and gate/up read one activation: quantize it once, one GEMM each group (where the GEMMs are native)
    shared = fuse_shared_inputs(model, dtype) if algo == "FP8" and native_fp8 else 0
    placed = None
    if dmap is not None:
        from accelerate import dispatch_model

        dispatch_model(model, device_map=dmap)  # hooks move activations between the devices of consecutive blocks
        placed = sorted({str(d) for d in dmap.values()})
        log.info("model.device_map=%s placed the engine on: %s", device_map, ", ".join(placed))
    kernels = sorted({type(m).__name__ + ": " + m.kernel for m in model.modules() if hasattr(m, "kernel")})
    plan = {"quant_algo": algo, "kv_cache": kv, "quantized_layers": len(replaced), "kernels": kernels,
            "shared_input_groups": shared, "devices": placed or [device.torch],
            "group_size": block, "dtype": str(dtype).removeprefix("torch.")}
    return model.eval(), plan


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, model, limits: Limits, device, plan: dict):
        super().__init__(limits, device.torch)
        self.model, self.plan = model, plan

    def _logits(self, tokens):
        with torch.no_grad():
            return self.model(tokens.to(self.device), use_cache=False).logits.float()

    def close(self) -> None:
        del self.model


def build_torch_engine(ctx, limits: Limits) -> TorchEngine:
    """Load the exported checkpoint; the engine manifest (plan + limits) is stored and reused."""
    from quantlab.artifacts import write_json_atomic
    from quantlab.env import versions

    ckpt = ctx.checkpoint()
    key = ctx.store.key("engine", engine="torch", arch=ctx.device.arch, torch=versions()["torch"],
                        model=ctx.ref.fingerprint, checkpoint=ckpt.fingerprint, limits=limits.describe(),
                        dtype=str(ctx.dtype), device_map=ctx.device_map)
    model, plan = load_exported(ckpt.path, ctx.device, ctx.dtype, ctx.device_map)

    def build(out: Path) -> dict:
        write_json_atomic(out / "engine.json", {"checkpoint": str(ckpt.path), "limits": limits.describe(), **plan})
        return {"limits": limits.describe(), **plan}

    art = ctx.store.get_or_build("engine", key, build, {"model": ctx.ref.fingerprint, "checkpoint": ckpt.fingerprint,
                                                        "device": ctx.device.describe(), "versions": versions()})
    log.info("engine: torch, %s, %s", plan["quant_algo"], "; ".join(plan["kernels"]))
    return TorchEngine(model, Limits(**art.info["limits"]), ctx.device, plan)
