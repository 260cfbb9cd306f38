"""Checks that reject impossible requests before any model forward pass, each naming the fix. They ask the
registries (precisions, engines, metrics) instead of knowing the modes themselves."""
from __future__ import annotations

import dataclasses

from quantlab import conventions
from quantlab.config import DEVICE_MAPS, STAGES, Config
from quantlab.engines.registry import engine_of
from quantlab.env import Device
from quantlab.errors import QuantlabError
from quantlab.precisions import kv_format, parse_block_size, precision_of


def _walk(node, prefix: str = ""):
    """(dotted key, value) of every leaf of a config dataclass, dicts included."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from _walk(getattr(node, f.name), f"{prefix}{f.name}.")
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


def check_no_empty_values(cfg: Config) -> None:
    """`model.path=` (an unset shell variable) must not mean "use the default": an explicitly empty string is an
    error wherever a value is expected. Null (no value) stays the documented default where a key allows it."""
    for key, value in _walk(cfg):
        if isinstance(value, str) and not value.strip():
            raise QuantlabError(f"{key} is empty (was a shell variable unset?)",
                                fix=f"give {key} a value, or leave the key out to use its default")


def check_config(cfg: Config) -> None:
    """Pure config checks: no files, no models."""
    if cfg.precision is None:
        raise QuantlabError("no precision chosen", fix="add +precision=fp8 (or int8_sq, int4_awq, w4a8_awq, nvfp4)")
    check_no_empty_values(cfg)
    if cfg.model.path:  # the cheapest refusal first: before torch is imported or the run dir is touched
        from quantlab.models import check_model_dir

        check_model_dir(cfg.model.path)
    precision = precision_of(cfg.precision)
    _check_counts(cfg)
    parse_block_size(cfg.precision)
    if cfg.model.device_map is not None and cfg.model.device_map not in DEVICE_MAPS:
        raise QuantlabError(f"model.device_map={cfg.model.device_map!r} is not supported",
                            fix=f"use one of {', '.join(DEVICE_MAPS)} (or model.device=cuda:N for one device)")
    _check_windows(cfg)
    kv_format(cfg.kv_cache)
    engine = engine_of(cfg.engine)
    _check_engine(cfg, engine, precision)
    check_options_take_effect(cfg, engine)
    if precision.name == "mixed" and not getattr(cfg.engine, "checkpoint", None) and not getattr(cfg, "search", None):
        raise QuantlabError("precision=mixed evaluates a checkpoint with per-layer formats; quantlab makes one only "
                            "through the search", fix="pass engine.checkpoint=DIR, or run python -m quantlab "
                                                      "+search=cheapest to find and export one")
    if precision.name == "external" and not getattr(cfg.engine, "checkpoint", None):
        raise QuantlabError("precision=external evaluates a checkpoint made elsewhere; there is nothing to quantize",
                            fix="pass engine.checkpoint=DIR (a ModelOpt, compressed-tensors, GPTQ / AWQ or GGUF "
                                "checkpoint), or choose a precision quantlab makes (fp8, int4_awq, ...)")
    from quantlab.gate.checks import check_gate

    check_gate(cfg.gate, precision.name, cfg.eval)  # a typo in a gate fails now, not after the evaluation
    from quantlab.rundir import CHECKPOINT_MODES

    if cfg.run_checkpoint not in CHECKPOINT_MODES:
        raise QuantlabError(f"run_checkpoint={cfg.run_checkpoint!r} is not one of {', '.join(CHECKPOINT_MODES)}",
                            fix="set run_checkpoint=hardlink (the default: the checkpoint's files hard-linked into "
                                "the run directory, copied across filesystems), copy, or symlink (a link into the "
                                "cache)")
    if cfg.audit_errors not in ("stop", "evaluate"):
        raise QuantlabError(f"audit_errors={cfg.audit_errors!r} is not one of stop, evaluate",
                            fix="set audit_errors=stop (the default: an audit error ends the run before evaluation) "
                                "or audit_errors=evaluate (evaluated anyway, the verdict FAIL)")
    if cfg.stop_after is not None and cfg.stop_after not in STAGES:
        raise QuantlabError(f"stop_after={cfg.stop_after!r} is not a stage", fix=f"use one of {', '.join(STAGES)}")


def _check_counts(cfg: Config) -> None:
    """Every count (samples, lengths, batches, engine limits) positive."""
    positive = {
        "calib.num_samples": cfg.calib.num_samples, "calib.seq_len": cfg.calib.seq_len,
        "calib.batch_size": cfg.calib.batch_size, "calib.pool_windows": cfg.calib.pool_windows,
        "eval.seq_len": cfg.eval.seq_len,
        "eval.batch_size": cfg.eval.batch_size,
        "engine.max_batch_size": cfg.engine.max_batch_size,
    }
    for knob in ("max_input_len", "max_seq_len", "tensor_parallel_size"):
        if getattr(cfg.engine, knob, None) is not None:
            positive[f"engine.{knob}"] = getattr(cfg.engine, knob)
    if cfg.eval.max_windows is not None:
        positive["eval.max_windows"] = cfg.eval.max_windows
    for knob, value in positive.items():
        if value <= 0:
            raise QuantlabError(f"{knob}={value} must be a positive number", fix=f"set {knob} to 1 or more")


def _check_windows(cfg: Config) -> None:
    """Windows that can score a token; prefix tokens and greedy generations that fit in them."""
    if cfg.eval.seq_len < 2:
        raise QuantlabError(f"eval.seq_len={cfg.eval.seq_len}: a window needs 2 tokens or more to score one",
                            fix="set eval.seq_len to 2 or more")
    for knob, data in (("calib", cfg.calib), ("eval", cfg.eval)):
        if data.prefix_token is not None and str(data.prefix_token).lower() not in conventions.CHOICES:
            raise QuantlabError(f"{knob}.prefix_token={data.prefix_token!r} is not supported",
                                fix="use auto (what the model expects), bos, eos or none")
        if data.prefix_token not in (None, "none") and data.seq_len < 2:
            raise QuantlabError(f"{knob}.seq_len={data.seq_len} leaves no room for text after the prefix token",
                                fix=f"set {knob}.seq_len to 2 or more")
    for knob in ("gen_prompts", "gen_prompt_len", "gen_tokens"):
        if getattr(cfg.eval, knob) < 0:
            raise QuantlabError(f"eval.{knob} must be 0 or more", fix=f"set eval.{knob} to 0 (off) or more")
    if cfg.eval.gen_prompts and cfg.eval.gen_tokens and cfg.eval.gen_prompt_len < 1:
        raise QuantlabError("eval.gen_prompt_len=0: a greedy continuation needs a prompt of 1 token or more",
                            fix="set eval.gen_prompt_len to 1 or more, or eval.gen_prompts=0 to turn generation off")
    if cfg.eval.gen_prompts and cfg.eval.gen_prompt_len >= cfg.eval.seq_len:
        raise QuantlabError(f"eval.gen_prompt_len={cfg.eval.gen_prompt_len} must be shorter than "
                            f"eval.seq_len={cfg.eval.seq_len}", fix="lower eval.gen_prompt_len")


def _check_engine(cfg: Config, engine, precision) -> None:
    """The engine is available here, runs this precision's checkpoints and knows its backend."""
    why_not = engine.available()
    if why_not:
        problem, _, fix = why_not.partition("\n  fix: ")
        raise QuantlabError(problem, fix=fix or None)
    if engine.runs == "checkpoint" and not engine.supports(precision.quant_algo):
        raise QuantlabError(f"engine={engine.name} does not run {precision.name} ({precision.quant_algo}) checkpoints",
                            fix="use engine=fakequant (ModelOpt simulation) or engine=trtllm on a supported GPU")
    if hasattr(cfg.engine, "base_url"):  # engine=served: URL, model, key, dialect before any compute
        from quantlab.engines.served import check_config

        check_config(cfg.engine, cfg.eval)
    if hasattr(cfg.engine, "trtllm_backend"):
        from quantlab.engines.trtllm import check_backend

        check_backend(cfg.engine)


def check_options_take_effect(cfg: Config, engine) -> None:
    """An option the chosen engine or mode would ignore is refused, not silently dropped (options that belong to
    one engine only are already refused by its schema)."""
    if cfg.eval.attribution and engine.runs != "checkpoint":
        raise QuantlabError(f"eval.attribution=true splits the loss of an engine that runs the exported checkpoint; "
                            f"engine={engine.name} runs the {engine.runs} itself",
                            fix="use engine=torch (or trtllm) with eval.attribution=true, or drop it")
    if engine.runs == "model" and cfg.kv_cache.dtype != "none":
        raise QuantlabError(f"kv_cache={cfg.kv_cache.dtype} has no effect on engine=reference, which evaluates the "
                            "unquantized model", fix="drop kv_cache, or choose the engine under test")
    if cfg.model.device_map and engine.name == "trtllm":
        raise QuantlabError("model.device_map places quantlab's own models; TensorRT-LLM splits a model with "
                            "engine.tensor_parallel_size",
                            fix="drop model.device_map and set engine.tensor_parallel_size")
    external = getattr(cfg.engine, "checkpoint", None)
    if external and cfg.stop_after == "quantize":
        raise QuantlabError("stop_after=quantize with engine.checkpoint: the checkpoint was made elsewhere, so there "
                            "is nothing to calibrate", fix="drop stop_after=quantize (stop_after=export audits it)")


def check_device(cfg: Config, device: Device) -> None:
    """The precision and KV format must have their GEMMs on this GPU (exit 2 naming the precisions it runs)."""
    precision, kv = precision_of(cfg.precision), kv_format(cfg.kv_cache)
    needs = [c for c in (precision.min_capability, kv.min_capability) if c]
    if device.type == "cuda" and needs and device.capability < max(needs):
        need = max(needs)
        kv_note = f" + {kv.name} kv cache" if kv.min_capability else ""
        raise QuantlabError(
            f"{precision.name}{kv_note} needs compute capability >= {need[0]}.{need[1]} ({precision.gpu_generation}); "
            f"{device.name} has {device.capability[0]}.{device.capability[1]}",
            fix=f"use a precision this GPU runs ({', '.join(_runnable(device))})"
                + (" with kv_cache=none" if kv.min_capability and device.capability < kv.min_capability else "")
                + ", or run on a newer GPU")


def check_family(cfg: Config, ref, ctx) -> None:
    """The model's family must be verified for this precision and KV format (README support table), and what the
    engine needs must run on this device (ModelOpt's NVFP4 fake-quant needs CUDA)."""
    from quantlab.families import check_supported

    family = check_supported(ref.config, ctx.precision.name, cfg.kv_cache.dtype, cfg.model.unverified_family)
    ref.family = family.name if family else None
    needs_fakequant = ctx.engine.runs == "calibrated" or cfg.eval.attribution
    if needs_fakequant and ctx.precision.name == "nvfp4" and ctx.device.type != "cuda":
        raise QuantlabError("ModelOpt's NVFP4 fake-quant model runs only on CUDA (its dynamic block quantizer), so "
                            "engine=fakequant and eval.attribution need a GPU for nvfp4",
                            fix="use engine=torch (it runs the NVFP4 export, emulated on a CPU), or run on a GPU")


def check_inputs(r) -> dict | None:
    """The checks that need the model (and nothing computed): its family for this precision and KV format, the
    lengths against its positions, and the quantization request (an impossible block size). Returns the recipe
    (None when the run does not quantize). The pipeline and the plan both call it (r: the run's Executor or
    Pricer)."""
    ctx = r.ctx
    ref = r.value("prepare")
    check_family(ctx.cfg, ref, ctx)
    check_lengths(ctx.cfg, ref.max_positions)
    if not r.has("quantize"):
        return None
    from quantlab.stages.quantize import request

    return request(r).recipe


def check_lengths(cfg: Config, max_positions: int | None) -> None:
    """calib.seq_len and eval.seq_len within the model's maximum positions."""
    for knob, value in (("calib.seq_len", cfg.calib.seq_len), ("eval.seq_len", cfg.eval.seq_len)):
        if max_positions and value > max_positions:
            raise QuantlabError(f"{knob}={value} is over the model's max positions ({max_positions})",
                                fix=f"set {knob} to {max_positions} or less")


def _runnable(device: Device) -> list[str]:
    """Precisions whose kernels this GPU has (from the registry: a new precision is listed by declaring it)."""
    from quantlab.precisions import PRECISIONS

    return [p.name for p in PRECISIONS.values() if p.modelopt_cfg  # mixed: only the search exports it
            and (not p.min_capability or device.capability >= p.min_capability)]
