"""Measured engine latency: search.cost=latency.

What is timed: one forward pass of `batch x tokens` token ids (a prefill; only the last position's logits are
computed, as a server does) through the model the engine runs: the exported checkpoint loaded by engine=torch
(each layer by its own format, the kernels the engine plan lists), or the unquantized model in the same dtype on
the same device. `warmup` passes first, then `repeats` timed passes (CUDA synchronized); the median is the
latency, the interquartile range its noise.

The search's latency model (latency_profile here; its algebra is quantlab.search.frontier.LatencyModel): the
unquantized model and every uniform format are measured; a format's cost per weight is (uniform latency -
unquantized latency) / searched weights, so a configuration's predicted latency is the unquantized latency plus,
per group, its weights times its format's cost per weight (linear layers' work is proportional to their weights at a
fixed token count). A format that is not at least `min_speedup` faster than the unquantized model when applied
everywhere is not faster: its cost per weight is clamped at 0 (it then never beats `none`, which loses nothing).
Every evaluated configuration is measured too, so the report shows predicted against measured.
"""
from __future__ import annotations

import inspect
import logging
import statistics
import time
from pathlib import Path

from quantlab.config import Config
from quantlab.search.candidates import export_candidate
from quantlab.search.frontier import Choice, LatencyModel, uniform
from quantlab.search.sensitivity import Sensitivity

log = logging.getLogger("quantlab")


def _tokens(vocab: int, batch: int, tokens: int, device):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, tokens), generator=g).to(device)


def time_forward(model, batch: int, tokens: int, repeats: int, warmup: int = 2) -> dict:
    """Median and interquartile range (ms) of `repeats` forward passes of batch x tokens ids."""
    import torch

    embed = model.get_input_embeddings()
    first = embed.weight.device
    ids = _tokens(embed.num_embeddings, batch, tokens, first)
    kwargs = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    cuda = first.type == "cuda"
    times = []
    with torch.no_grad():  # as the engine runs
        for i in range(warmup + repeats):
            if cuda:
                torch.cuda.synchronize(first)
            start = time.perf_counter()
            model(ids, **kwargs)
            if cuda:
                torch.cuda.synchronize(first)
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1000.0)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"ms": statistics.median(times), "iqr_ms": [q[0], q[2]], "repeats": repeats, "batch": batch,
            "tokens": tokens}


def measure_export(path: Path, device, dtype, batch: int, tokens: int, repeats: int,
                   device_map: str | None = None) -> dict:
    """The exported checkpoint's latency in engine=torch (loaded as the engine loads it)."""
    import gc

    from quantlab.engines.torch_engine import load_exported

    model, plan = load_exported(Path(path), device, dtype, device_map)
    try:
        out = time_forward(model, batch, tokens, repeats)
    finally:
        del model
        gc.collect()
        _empty_cache(device)
    out["kernels"] = plan.get("kernels")
    return out


def measure_reference(ref, device, dtype, batch: int, tokens: int, repeats: int,
                      device_map: str | None = None) -> dict:
    """The unquantized model's latency, same dtype and device."""
    import gc

    from quantlab.models import load_model

    model = load_model(ref, device, dtype, device_map)
    try:
        return time_forward(model, batch, tokens, repeats)
    finally:
        del model
        gc.collect()
        _empty_cache(device)


def _empty_cache(device) -> None:
    import torch

    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def per_weight_costs(none_ms: float, uniform_ms: dict[str, float], searched_weights: int,
                     min_speedup: float) -> tuple[dict[str, float], list[str]]:
    """(format -> ms per weight relative to the unquantized model, formats treated as not faster). `none` is 0."""
    costs, slow = {"none": 0.0}, []
    for name, ms in uniform_ms.items():
        if ms <= (1.0 - min_speedup) * none_ms:
            costs[name] = (ms - none_ms) / searched_weights
        else:
            costs[name] = max(ms - none_ms, 0.0) / searched_weights
            slow.append(name)
    return costs, slow


def measure_latency(cfg: Config, ctx, path: Path | None, ref=None) -> dict:
    """search.cost=latency: an export's latency in engine=torch, or (path None) the unquantized model's (ref)."""
    s = cfg.search
    args = (ctx.device, ctx.dtype, s.latency_batch, s.latency_tokens or cfg.eval.seq_len, s.latency_repeats,
            cfg.model.device_map)
    return measure_reference(ref, *args) if path is None else measure_export(path, *args)


def latency_profile(sens: Sensitivity, choices: dict[str, Choice], ref, kv: str,
                    timings: dict[str, dict]) -> LatencyModel:
    """The unquantized model and every uniform format (exported; the exports are the search's own cached
    artifacts) timed in engine=torch; each format's cost per weight from them.

    Args:
        sens: the search's sensitivity (config, context, groups and fixed parameters; exports the uniform formats).
        choices: choice name -> Choice.
        ref: the prepared unquantized model (quantlab.models.ModelRef).
        kv: the KV cache format of the uniform exports.
        timings: export path -> measurement, filled with each uniform export's (an evaluation reuses it).

    Returns:
        The latency model the frontier's costs come from.
    """
    cfg, ctx, groups = sens.cfg, sens.ctx, sens.groups
    measured = {"none": measure_latency(cfg, ctx, None, ref)}
    for name in choices:
        if name == "none":
            continue
        path = export_candidate(sens, uniform(groups, choices, name, sens.fixed_params), kv)
        measured[name] = timings[str(path)] = measure_latency(cfg, ctx, path)
    none_ms = measured["none"]["ms"]
    per_weight, slow = per_weight_costs(none_ms, {n: m["ms"] for n, m in measured.items() if n != "none"},
                                        sum(g.params for g in groups), cfg.search.min_speedup)
    log.info("search: latency of a %d x %d prefill in engine=torch: %s", cfg.search.latency_batch,
             cfg.search.latency_tokens or cfg.eval.seq_len,
             ", ".join(f"{n} {m['ms']:.1f} ms" for n, m in measured.items()))
    return LatencyModel(none_ms, per_weight, measured, slow)
