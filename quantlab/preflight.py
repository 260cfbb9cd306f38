"""Checks that reject impossible requests before any model forward pass, each naming the fix."""
from __future__ import annotations

from quantlab.config import DEVICE_MAPS, Config
from quantlab.env import Device
from quantlab.errors import QuantlabError
from quantlab.precisions import REGISTRY, effective_block_size, kv_quant_algo, spec_for

ENGINES = ("torch", "fakequant", "trtllm", "reference")


def check_config(cfg: Config) -> None:
    """Pure config checks: no files, no models."""
    if cfg.precision is None:
        names = ", ".join(s.__name__ for s in REGISTRY)
        raise QuantlabError(f"no precision chosen ({names})",
                            fix="add +precision=fp8 (or int8_sq, int4_awq, w4a8_awq, nvfp4) to the command")
    positive = {
        "calib.num_samples": cfg.calib.num_samples, "calib.seq_len": cfg.calib.seq_len,
        "calib.batch_size": cfg.calib.batch_size, "eval.seq_len": cfg.eval.seq_len,
        "eval.batch_size": cfg.eval.batch_size, "eval.topk": cfg.eval.topk,
        "engine.max_batch_size": cfg.engine.max_batch_size, "engine.tensor_parallel_size": cfg.engine.tensor_parallel_size,
    }
    if cfg.eval.max_windows is not None:
        positive["eval.max_windows"] = cfg.eval.max_windows
    block = getattr(cfg.precision, "block_size", None)
    if block is not None:
        positive["precision.block_size"] = block
    for knob, value in positive.items():
        if value <= 0:
            raise QuantlabError(f"{knob}={value} must be a positive number", fix=f"set {knob} to 1 or more")
    if cfg.model.device_map is not None and cfg.model.device_map not in DEVICE_MAPS:
        raise QuantlabError(f"model.device_map={cfg.model.device_map!r} is not supported",
                            fix=f"use one of {', '.join(DEVICE_MAPS)} (or model.device=cuda:N for one device)")
    if cfg.eval.seq_len < 2:
        raise QuantlabError(f"eval.seq_len={cfg.eval.seq_len}: a window needs 2 tokens or more to score one",
                            fix="set eval.seq_len to 2 or more")
    for knob, data in (("calib", cfg.calib), ("eval", cfg.eval)):
        if data.prefix_token not in (None, "eos", "bos"):
            raise QuantlabError(f"{knob}.prefix_token={data.prefix_token!r} is not supported", fix="use eos, bos or null")
        if data.prefix_token and data.seq_len < 2:
            raise QuantlabError(f"{knob}.seq_len={data.seq_len} leaves no room for text after the prefix token",
                                fix=f"set {knob}.seq_len to 2 or more")
    for knob in ("eval.gen_prompts", "eval.gen_prompt_len", "eval.gen_tokens"):
        if getattr(cfg.eval, knob.split(".")[1]) < 0:
            raise QuantlabError(f"{knob} must be 0 or more")
    if cfg.eval.gen_prompts and cfg.eval.gen_prompt_len >= cfg.eval.seq_len:
        raise QuantlabError(f"eval.gen_prompt_len={cfg.eval.gen_prompt_len} must be shorter than eval.seq_len={cfg.eval.seq_len}")
    kv_quant_algo(cfg.kv_cache)
    from quantlab.engines.torch_engine import SUPPORTED
    from quantlab.engines.trtllm import check_available

    if cfg.engine.name == "trtllm":
        check_available()

    if cfg.engine.name == "torch" and spec_for(cfg.precision).quant_algo not in SUPPORTED:
        raise QuantlabError(f"engine=torch runs fp8, int8_sq and int4_awq; {cfg.precision.name} is not one of them",
                            fix="use engine=fakequant (ModelOpt simulation) or engine=trtllm on a supported GPU")
    if cfg.engine.name not in ENGINES:
        from difflib import get_close_matches

        close = get_close_matches(cfg.engine.name, ENGINES, n=1)
        raise QuantlabError(f"engine {cfg.engine.name!r} is unknown" + (f"; did you mean {close[0]!r}?" if close else ""),
                            fix=f"use engine={'|'.join(ENGINES)}")
    from quantlab.stages.gate import thresholds_for

    thresholds_for(cfg.gate, cfg.precision.name)  # a typo in a gate fails now, not after the evaluation
    if cfg.stop_after not in (None, "prepare", "data", "quantize", "export", "build", "evaluate"):
        raise QuantlabError(f"stop_after={cfg.stop_after!r} is not a stage",
                            fix="use one of prepare, data, quantize, export, build, evaluate")


def check_device(cfg: Config, device: Device) -> None:
    spec = spec_for(cfg.precision)
    needs = [spec.min_capability] if spec.min_capability else []
    if cfg.kv_cache.dtype == "fp8":
        needs.append((8, 9))
    if device.type == "cuda" and needs and device.capability < max(needs):
        need = max(needs)
        raise QuantlabError(
            f"{cfg.precision.name}{' + fp8 kv cache' if cfg.kv_cache.dtype == 'fp8' else ''} needs compute capability "
            f">= {need[0]}.{need[1]} ({spec.gpu_generation}); {device.name} has {device.capability[0]}.{device.capability[1]}",
            fix="use int8_sq or int4_awq with kv_cache=none on this GPU, or run on a newer GPU")


def quantized_linear_in_dims(model_path, trust_remote_code: bool = False) -> dict[str, int]:
    """Input dimension of every Linear that gets quantized (lm_head stays in high precision)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    dims = {}
    for name, module in skeleton.named_modules():
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
            short = name.split(".")[-1]
            dims.setdefault(short, module.in_features)
    return dims


def check_block_size(cfg: Config, model_path, preferred: int | None, trust_remote_code: bool = False) -> int | None:
    block = effective_block_size(cfg.precision, preferred)
    if block is None:
        return None
    dims = quantized_linear_in_dims(model_path, trust_remote_code)
    bad = {name: d for name, d in dims.items() if d % block}
    if bad:
        candidates = [b for b in (128, 64, 32, 16, 8) if all(d % b == 0 for d in dims.values())]
        where = ", ".join(f"{n} in={d}" for n, d in sorted(bad.items()))
        fix = f"use precision.block_size={candidates[0]}" if candidates else "this model's dimensions admit no AWQ block size"
        raise QuantlabError(f"AWQ block size {block} does not divide the input dimension of quantized layers ({where})", fix=fix)
    return block


def check_lengths(cfg: Config, max_positions: int | None) -> None:
    for knob, value in (("calib.seq_len", cfg.calib.seq_len), ("eval.seq_len", cfg.eval.seq_len)):
        if max_positions and value > max_positions:
            raise QuantlabError(f"{knob}={value} is over the model's max positions ({max_positions})",
                                fix=f"set {knob} to {max_positions} or less")
