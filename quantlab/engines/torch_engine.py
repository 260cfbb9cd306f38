"""engine=torch: the exported checkpoint executed with deployment numerics.

Reads only what ships (hf_quant_config.json + safetensors): an HF skeleton from config.json, every quantized
Linear replaced by its QLAYERS class (per layer, so mixed-precision exports run too), MoE experts by per-expert
quantized layers (quantlab.engines.moe), buffers the checkpoint never holds rebuilt (RoPE, Gemma's embed_scale),
FP8 KV cache applied where attention reads K/V (after RoPE, as the cache stores them) on top of the model's own
attention and masks (sliding windows and soft-capping kept). Tensor names are mapped between memory and disk with
transformers' conversion mapping. Missing scales, wrong dtypes or shapes are reported by tensor name.
`load_exported` reads top down as the steps it takes.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from quantlab.checkpoint import QUANTIZED_DTYPES, CheckpointTensors, QuantConfig
from quantlab.config import DEVICE_MAPS
from quantlab.engines import foreign  # noqa: F401 - registers the layer classes of other tools' formats in QLAYERS
from quantlab.engines.base import Limits
from quantlab.engines.fusion_fp8 import fuse_shared_inputs, use_fp8_gemv
from quantlab.engines.fusion_int4 import fuse_int4_siblings
from quantlab.engines.hf import HFModelEngine
from quantlab.engines.moe import swap_experts
from quantlab.engines.qlayers import QLAYERS, LayerContext, checked_scale, fp8_qdq
from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")
ATTN_NAME = "quantlab_fp8_kv_{}"  # one registered name per base implementation (its mask builder differs)


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """K (after RoPE) and V as the FP8 cache stores and returns them, then the model's own attention (its masks,
    sliding windows, soft-capping and scaling untouched)."""
    return module.quantlab_base_attention(module, query, fp8_qdq(key, module.quantlab_k_scale),
                                          fp8_qdq(value, module.quantlab_v_scale), attention_mask, **kwargs)


# ------------------------------------------------------------------------------------------------ steps
def check_formats(quant: QuantConfig, ckpt: Path) -> None:
    """Every format the checkpoint declares must have a QLAYERS class (exit 2 naming the others)."""
    unsupported = sorted(a for a in quant.algos() if a not in QLAYERS)
    if unsupported or not quant.algos():
        raise QuantlabError(f"engine=torch runs {', '.join(QLAYERS)}; checkpoint {ckpt} is "
                            f"{', '.join(unsupported) or quant.quant_algo}",
                            fix="use engine=fakequant (simulation) or engine=trtllm for this format")


def skeleton(ckpt: Path, dtype: torch.dtype, config=None):
    """The model built from config.json (or the given transformers config: a GGUF file's) on the meta device (no
    memory), its config, and the map from in-memory tensor names to the checkpoint's
    (quantlab.families.memory_to_disk)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantlab.families import memory_to_disk
    from quantlab.models import attn_implementation

    config = config if config is not None else AutoConfig.from_pretrained(ckpt)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we build the quantized layers ourselves
    kwargs = {"dtype": dtype}
    implementation = attn_implementation(config.to_dict())
    if implementation:
        kwargs["attn_implementation"] = implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model, config, memory_to_disk(model)


def placement(model: nn.Module, device, dtype: torch.dtype, device_map: str | None):
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


def swap_quantized_linears(model: nn.Module, t: CheckpointTensors, quant: QuantConfig, device, dtype, where,
                           to_disk: dict[str, str]) -> dict:
    """Replace every Linear the export quantized by its QLAYERS class; returns module name -> quant_algo."""
    replaced = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        disk = to_disk.get(f"{name}.weight", f"{name}.weight").removesuffix(".weight")
        fmt = quant.format_of(disk)
        marker = getattr(QLAYERS[fmt.quant_algo], "marker", "weight_scale") if fmt is not None else None
        if fmt is None or f"{disk}.{marker}" not in t:
            if t.dtype_of(f"{disk}.weight") in QUANTIZED_DTYPES:
                t.get(f"{disk}.weight_scale")  # a quantized weight without its scale: report the missing tensor
            continue
        target = where(name)
        ctx = LayerContext(target, device.type == "cuda" and device.has_fp8 and target.startswith("cuda"), dtype)
        layer = QLAYERS[fmt.quant_algo].from_checkpoint(disk, module.out_features, module.in_features,
                                                          module.bias is not None, t, fmt, ctx)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer.to(target))
        replaced[name] = fmt.quant_algo
    return replaced


def load_plain_weights(model: nn.Module, t: CheckpointTensors, dtype, where, to_disk: dict[str, str]) -> None:
    """Everything else (embeddings, norms, routers, lm_head, unquantized layers) is plain high-precision weights,
    read under its checkpoint name. Tied weights and non-persistent buffers are not demanded from the files."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    persistent = set(model.state_dict())
    state = {}
    for key, param in list(model.named_parameters()) + list(model.named_buffers()):
        if param.device.type != "meta":
            continue
        disk = to_disk.get(key, key)
        if disk in t:
            state[key] = t.get(disk, shape=tuple(param.shape)).to(
                device=where(key), dtype=dtype if param.is_floating_point() else param.dtype)
        elif key not in tied and key in persistent:
            raise QuantlabError(f"exported checkpoint {t.ckpt} is missing tensor {disk}",
                                fix="re-export the checkpoint")
    model.load_state_dict(state, strict=False, assign=True)  # replaces the meta tensors; quantized layers untouched
    if tied:
        model.tie_weights()


def rebuild_buffers(model: nn.Module, where) -> None:
    """Buffers computed at init and never saved (RoPE frequencies, Gemma's embed_scale) do not exist on the meta
    skeleton: rebuild them as the model's own constructor does."""
    for name, mod in list(model.named_modules()):
        if not any(b.device.type == "meta" for b in mod.buffers(recurse=False)):
            continue
        target = where(name)
        if type(mod).__name__.endswith("RotaryEmbedding") and hasattr(mod, "config"):
            try:
                rebuilt = type(mod)(mod.config, device=target)
            except TypeError:  # Gemma 3's dual RoPE takes the config only
                rebuilt = type(mod)(mod.config).to(target)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, rebuilt)
        elif hasattr(mod, "scalar_embed_scale"):  # Gemma's scaled embedding: sqrt(hidden_size)
            mod.register_buffer("embed_scale", torch.tensor(float(mod.scalar_embed_scale), device=target),
                                persistent=False)


def check_materialized(model: nn.Module, ckpt: Path) -> None:
    """Every parameter and buffer was loaded or rebuilt (none left on the meta device)."""
    leftover = [k for k, v in list(model.named_parameters()) + list(model.named_buffers()) if v.device.type == "meta"]
    if leftover:
        raise QuantlabError(f"exported checkpoint {ckpt} does not provide {', '.join(leftover[:5])}",
                            fix="re-export the checkpoint")


def _base_attention(module: nn.Module, implementation: str):
    """The attention function the model runs with: eager is each modeling file's own function."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation == "eager":
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise QuantlabError(f"{type(module).__name__} has no eager attention function to wrap with the "
                                "FP8 KV cache",
                                fix="this attention layout is not supported with kv_cache=fp8 yet")
        return eager
    return ALL_ATTENTION_FUNCTIONS[implementation]


def apply_kv_cache(model: nn.Module, t: CheckpointTensors, quant: QuantConfig, where,
                   to_memory: dict[str, str], kv_names: tuple[str, str] = ("k_proj.k_scale", "v_proj.v_scale")
                   ) -> str | None:
    """FP8 KV cache: K (after RoPE) and V quantized with the exported k_scale / v_scale where attention reads them.
    ModelOpt names the scales <attention>.k_proj.k_scale whatever the layout (Phi-3's fused qkv_proj, GPT-NeoX's
    query_key_value), so they are resolved to the attention module, not to a linear; other formats name them
    <attention>.<kv_names> (compressed-tensors: <attention>.k_scale), as a scalar or a 1-element tensor."""
    if quant.kv_cache_quant_algo is None:
        return None
    if quant.kv_cache_quant_algo != "FP8":
        raise QuantlabError(f"engine=torch does not run kv_cache_quant_algo={quant.kv_cache_quant_algo}",
                            fix="export with kv_cache=fp8 or none")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    base = model.config._attn_implementation or "sdpa"
    if base not in ("sdpa", "eager"):
        raise QuantlabError(f"kv_cache=fp8 runs on sdpa or eager attention; this model uses {base}",
                            fix="load the model with sdpa or eager attention")
    name = ATTN_NAME.format(base)
    AttentionInterface.register(name, _fp8_kv_attention)
    AttentionMaskInterface.register(name, sdpa_mask if base == "sdpa" else eager_mask)  # keeps sliding windows
    k_name, v_name = kv_names
    attentions = sorted(n.removesuffix(f".{k_name}") for n in t.names() if n.endswith(f".{k_name}"))
    if not attentions:
        raise QuantlabError(f"checkpoint {t.ckpt} says kv_cache_quant_algo=FP8 but holds no k_scale tensor",
                            fix="re-export the checkpoint with kv_cache=fp8")
    # every attention module of the model needs its scales: one missing would run that layer unquantized (or fail)
    have = {to_memory.get(disk, disk) for disk in attentions}
    to_disk = {m: d for d, m in to_memory.items()}
    missing = sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("Attention") and n not in have)
    if missing:
        raise QuantlabError(f"exported checkpoint {t.ckpt} is missing tensor "
                            f"{to_disk.get(missing[0], missing[0])}.{k_name} (KV scales of {len(missing)} "
                            "attention module(s) absent though kv_cache_quant_algo=FP8)",
                            fix="re-export the checkpoint with kv_cache=fp8")
    for disk in attentions:
        memory = to_memory.get(disk, disk)
        try:
            module = model.get_submodule(memory)
        except AttributeError:
            raise QuantlabError(f"checkpoint {t.ckpt} has KV scales for {disk}, which this model does not have",
                                fix="the checkpoint and its config.json do not match; re-export it") from None
        module.quantlab_k_scale = _kv_scale(f"{disk}.{k_name}", t).to(where(memory))
        module.quantlab_v_scale = _kv_scale(f"{disk}.{v_name}", t).to(where(memory))
        module.quantlab_base_attention = _base_attention(module, base)
    model.set_attn_implementation(name)
    return f"fp8 (k_scale / v_scale on {len(attentions)} attention modules, applied after RoPE, over {base} attention)"


def _kv_scale(name: str, t: CheckpointTensors) -> torch.Tensor:
    """A per-tensor KV scale stored as a scalar (ModelOpt) or a 1-element tensor (compressed-tensors)."""
    shape = t.shape_of(name)
    return checked_scale(name, t, shape if shape in ((), (1,)) else ()).float().reshape(())


def dispatch(model: nn.Module, dmap, device_map: str | None) -> list[str] | None:
    """Spread the model over the GPUs of an accelerate device map (None: one device); the devices used."""
    if dmap is None:
        return None
    from accelerate import dispatch_model

    dispatch_model(model, device_map=dmap)  # hooks move activations between the devices of consecutive blocks
    placed = sorted({str(d) for d in dmap.values()})
    log.info("model.device_map=%s placed the engine on: %s", device_map, ", ".join(placed))
    return placed


def kernel_context(kernels=None):
    """engine.kernels (a KernelsConfig; None: the defaults) as the kernels read it (the env override included)."""
    from quantlab.engines.kernels.device import KernelContext
    from quantlab.engines.registry import KernelsConfig

    resolved = (kernels if kernels is not None else KernelsConfig()).resolved()
    return KernelContext(frozenset(resolved["disabled"]), resolved["pdl"], resolved["compile_edges"],
                         resolved["combo_kernels"])


def kernel_choices(model: nn.Module) -> dict:
    """Per layer shape ("N x K"), the kernel its format's priority list chose at load and every refusal's reason
    (quantlab.engines.kernels.api.choose), for the plan in engine.json and run.json."""
    out = {}
    for m in model.modules():
        choice = getattr(m, "choice", None)
        if isinstance(choice, dict):
            out.setdefault(f"{m.out_features}x{m.in_features}", choice)
    return dict(sorted(out.items()))


def load_exported(ckpt: Path, device, dtype: torch.dtype, device_map: str | None = None,
                  kernels=None) -> tuple[nn.Module, dict]:
    """The exported checkpoint as a runnable model, and a plan saying which kernel runs each layer. kernels:
    engine.kernels (a KernelsConfig; None: the defaults), configured for every kernel before any layer is built."""
    from quantlab.engines.kernels import device as kernel_device
    from quantlab.formats import open_checkpoint

    kernel_device.configure(kernel_context(kernels))

    ckpt = Path(ckpt)
    opened = open_checkpoint(ckpt)  # ModelOpt's unified format or another tool's (quantlab.formats)
    quant, tensors = opened.quant, opened.tensors
    check_formats(quant, ckpt)
    model, config, to_disk = skeleton(opened.directory, dtype, opened.transformers_config())
    to_memory = {d.rpartition(".")[0]: m.rpartition(".")[0] for m, d in to_disk.items()}
    where, dmap = placement(model, device, dtype, device_map)
    replaced = swap_quantized_linears(model, tensors, quant, device, dtype, where, to_disk)
    experts = swap_experts(model, tensors, quant, device, dtype, where, to_disk)
    if not replaced and not experts:
        raise QuantlabError(f"checkpoint {ckpt} says {quant.quant_algo} but no layer holds its quantized tensors",
                            fix="re-export the checkpoint")
    load_plain_weights(model, tensors, dtype, where, to_disk)
    rebuild_buffers(model, where)
    check_materialized(model, ckpt)
    kv = apply_kv_cache(model, tensors, quant, where, to_memory, opened.kv_names)
    # q/k/v and gate/up read one activation: quantize it once, one GEMM each group (where the GEMMs are native)
    native = device.type == "cuda" and device.has_fp8
    shared = fuse_shared_inputs(model, dtype) if native else 0  # fuses FP8 siblings only
    shared += fuse_int4_siblings(model) if device.type == "cuda" else 0  # packed W4A16 (GPU layers only)
    placed = dispatch(model, dmap, device_map)
    gemv = use_fp8_gemv(model) if native else 0  # one-row FP8 GEMMs: quantlab's kernel where measured faster
    kernels = sorted({type(m).__name__ + ": " + m.kernel for m in model.modules() if hasattr(m, "kernel")})
    plan = {"quant_algo": quant.quant_algo, "format": opened.format, "scheme": opened.scheme, "kv_cache": kv,
            "quantized_layers": len(replaced),
            "quantized_expert_projections": experts, "kernels": kernels,
            "formats": {a: sum(1 for v in replaced.values() if v == a) for a in sorted(set(replaced.values()))},
            "shared_input_groups": shared, "fp8_gemv_gemms": gemv, "devices": placed or [device.torch],
            "group_size": quant.group_size, "dtype": str(dtype).removeprefix("torch."),
            "kernel_switches": kernel_device.current().describe(), "kernel_choices": kernel_choices(model)}
    return model.eval(), plan


# ------------------------------------------------------------------------------------------------ engine
class TorchEngine(HFModelEngine):
    """The exported checkpoint loaded by load_exported; `plan` says which kernel runs each layer."""

    def __init__(self, model, limits: Limits, device, plan: dict):
        super().__init__(model, limits, "torch", device.torch)
        self.plan = plan


def build(engine_cfg, inputs, limits: Limits) -> TorchEngine:
    """Load the exported checkpoint; the engine manifest (plan + limits) is stored and reused."""
    from quantlab.artifacts import write_json_atomic
    from quantlab.env import versions

    ckpt = inputs.checkpoint()
    kernels = getattr(engine_cfg, "kernels", None)
    key = inputs.store.key("engine", engine="torch", arch=inputs.device.arch, torch=versions()["torch"],
                           model=inputs.ref.fingerprint, checkpoint=ckpt.fingerprint, limits=limits.describe(),
                           dtype=str(inputs.dtype), device_map=inputs.device_map,
                           **({} if kernels is None or kernels.is_default() else {"kernels": kernels.resolved()}))
    model, plan = load_exported(ckpt.path, inputs.device, inputs.dtype, inputs.device_map, kernels)

    def write(out: Path) -> dict:
        write_json_atomic(out / "engine.json", {"checkpoint": str(ckpt.path), "limits": limits.describe(), **plan})
        return {"limits": limits.describe(), **plan}

    art, _ = inputs.store.get_or_build("engine", key, write, {"model": inputs.ref.fingerprint,
                                                             "checkpoint": ckpt.fingerprint,
                                                             "device": inputs.device.describe(),
                                                             "versions": versions()})
    log.info("engine: torch, %s, %s", plan["quant_algo"], "; ".join(plan["kernels"]))
    return TorchEngine(model, Limits(**art.info["limits"]), inputs.device, plan)
