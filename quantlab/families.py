"""Model families: what quantlab has verified for each (the README's support table is this registry), how a
family must be loaded, and how transformers names its tensors on disk versus in memory.

A family is a config's model_type. Families outside the registry are refused before calibration (exit 2) with what
would be needed; `model.unverified_family=true` runs one anyway and marks the report as unverified.

On-disk names: transformers 5 renames and fuses some weights at load time (GPT-NeoX's embed_out is lm_head in
memory; Mixtral's per-expert w1/w3 are stacked into one gate_up_proj). `disk_names` computes, from the meta skeleton
alone, the names and shapes the files must have, with transformers' own conversion mapping (the one save_pretrained
reverses), so checks compare with what transformers loads, never with module names.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from quantlab.errors import QuantlabError
from quantlab.registry import Registry


@dataclass(frozen=True)
class Family:
    """Facts about one model family (config model_type)."""

    name: str
    precisions: tuple[str, ...]  # verified end to end on CPU (engine vs fake-quant in tests/test_families.py)
    kv_fp8: bool = True  # FP8 KV cache verified
    moe: bool = False
    attn_implementation: str | None = None  # what the reference must load with (eager: soft-capping honoured)
    notes: str = ""
    gpu: tuple[str, ...] = field(default_factory=tuple)  # verified on the H200 (bench/RESULTS.md)
    refused: dict = field(default_factory=dict)  # precision -> why it cannot work for this family (exit 2 says so)
    bos: bool = False  # trained with BOS before every sequence (quantlab.conventions: prefix_token=auto gives bos)


DENSE = ("fp8", "fp8_pc_pt", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4", "mixed")
# engine vs fake-quant as exported, kv none and fp8, on the H200 in bf16 (bench/family_matrix.py, bench/RESULTS.md);
# NVFP4 needs sm_100 and is refused there
GPU_DENSE = ("fp8", "fp8_pc_pt", "int8_sq", "int4_awq", "w4a8_awq")
GPU_MOE = ("fp8", "int4_awq")
MOE_NO_SMOOTHQUANT = {"int8_sq": "ModelOpt 0.47 does not SmoothQuant fused MoE experts: the export declares "
                                "W8A8_SQ_PER_CHANNEL but ships no pre_quant_scale for any expert, so no engine can "
                                "run it as declared (the audit reports it)"}
FAMILIES: Registry[Family] = Registry("model family", "a model whose config.json model_type is one of")
for _f in [
    Family("llama", DENSE + ("external",), gpu=GPU_DENSE,
           notes="external: compressed-tensors, GPTQ / AWQ and GGUF checkpoints (tests/test_formats.py)"),
    Family("mistral", DENSE, gpu=GPU_DENSE, notes="sliding-window attention kept with FP8 KV"),
    Family("qwen2", DENSE + ("external",), gpu=GPU_DENSE),
    Family("qwen3", DENSE, gpu=GPU_DENSE),
    Family("phi3", DENSE, gpu=GPU_DENSE, notes="fused qkv_proj / gate_up_proj; FP8 KV scales on the attention module"),
    Family("olmo2", DENSE, gpu=GPU_DENSE),
    Family("granite", DENSE, gpu=GPU_DENSE, notes="logits divided by logits_scaling"),
    Family("gpt_neox", DENSE, gpu=GPU_DENSE, notes="fused query_key_value, partial rotary; disk embed_out = lm_head"),
    Family("opt", DENSE, gpu=GPU_DENSE, notes="LayerNorm input quantizers disabled (the export ships none)"),
    Family("gemma", DENSE, gpu=GPU_DENSE, bos=True, notes="embed_scale rebuilt, never read from a checkpoint"),
    Family("gemma2", DENSE, gpu=GPU_DENSE, bos=True, attn_implementation="eager",
           notes="attention and final logit soft-capping; sliding/global alternation"),
    Family("gemma3_text", DENSE, gpu=GPU_DENSE, bos=True, attn_implementation="eager",
           notes="dual RoPE (local / global bases); sliding/global alternation"),
    Family("mixtral", ("fp8", "int4_awq", "nvfp4"), moe=True, gpu=GPU_MOE,
           notes="router in high precision; experts per format", refused=MOE_NO_SMOOTHQUANT),
    Family("qwen3_moe", ("fp8", "int4_awq", "nvfp4"), moe=True, gpu=GPU_MOE,
           notes="router in high precision; experts per format", refused=MOE_NO_SMOOTHQUANT),
]:
    FAMILIES.add(_f.name, _f)


def family_of(config: dict, allow_unverified: bool = False) -> Family | None:
    """The family of a config.json; unknown families are refused unless allowed (then None)."""
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if allow_unverified:
        return None
    raise QuantlabError(f"model family {model_type!r} is not one quantlab has verified (verified: "
                        f"{', '.join(FAMILIES)})",
                        fix="it would need its layouts checked end to end (tests/test_families.py); to run it anyway, "
                            "unverified, pass model.unverified_family=true")


def check_supported(config: dict, precision: str, kv: str, allow_unverified: bool = False) -> Family | None:
    """Refuse, before calibration, a precision or KV cache format not verified for the family."""
    family = family_of(config, allow_unverified)
    if family is None:
        return None
    if precision in family.refused:
        raise QuantlabError(f"{precision} cannot be run on the {family.name} family: {family.refused[precision]}",
                            fix=f"choose one of {', '.join(family.precisions)}")
    if precision not in family.precisions:
        raise QuantlabError(f"{precision} is not verified for the {family.name} family (verified: "
                            f"{', '.join(family.precisions)})",
                            fix="choose one of those precisions, or pass model.unverified_family=true to run it anyway")
    if kv != "none" and not family.kv_fp8:
        raise QuantlabError(f"kv_cache={kv} is not verified for the {family.name} family",
                            fix="use kv_cache=none, or pass model.unverified_family=true")
    return family


# ------------------------------------------------------------------------------------------ tensor names
def _meta_state(skeleton) -> dict:
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = dict(skeleton.state_dict())
    try:
        return dict(remove_tied_weights_from_state_dict(state, skeleton))
    except Exception:  # noqa: BLE001 - older signatures: drop the declared tied keys by hand
        tied = set(getattr(skeleton, "all_tied_weights_keys", None) or {})
        return {k: v for k, v in state.items() if k not in tied}


def disk_names(skeleton) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, as save_pretrained writes the model (and so as the files must hold it)."""
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(skeleton, _meta_state(skeleton))
    return {name: tuple(t.shape) for name, t in reverted.items()}


def memory_to_disk(skeleton) -> dict[str, str]:
    """In-memory name -> on-disk name of every tensor that is only renamed (not split or fused) on disk."""
    from transformers.core_model_loading import revert_weight_conversion

    state = _meta_state(skeleton)
    by_id = {id(t): name for name, t in state.items()}
    reverted = revert_weight_conversion(skeleton, state)
    return {by_id[id(t)]: disk for disk, t in reverted.items() if id(t) in by_id}
