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
fixed token count). Every evaluated configuration is measured too, so the report shows predicted against measured.

Deciding with noise: each uniform format is timed *paired* with the unquantized model, both loaded, in alternating
rounds (A B B A ...), so a machine that gets busier or quieter slows both sides of a round alike; a round's ratio is
format / unquantized. The median ratio's distribution-free bounds (order statistics, each at 5% / 4 one-sided: at
most 4 looks) decide: the format is faster when the upper bound is below 1 - min_speedup, not faster when the lower
bound is above; otherwise `repeats` more rounds are timed, up to 4 x repeats, and a format still undecided is treated as
not faster ("within the timing noise": a search must not pick a winner from noise). A format that is not faster has
its cost per weight clamped at 0 (it then never beats `none`, which loses nothing).
"""
from __future__ import annotations

import inspect
import logging
import statistics
import time
from pathlib import Path

from quantlab.config import Config
from quantlab.gate.stats import median_interval as _median_interval
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
    embed = model.get_input_embeddings()
    first = embed.weight.device
    ids = _tokens(embed.num_embeddings, batch, tokens, first)
    kwargs, cuda = _forward_kwargs(model), first.type == "cuda"
    for _ in range(warmup):
        _time_once(model, ids, kwargs, cuda, first)
    return _summary([_time_once(model, ids, kwargs, cuda, first) for _ in range(repeats)], batch, tokens)


def _time_once(model, ids, kwargs, cuda: bool, device) -> float:
    """Milliseconds of one forward pass (CUDA synchronized)."""
    import torch

    with torch.no_grad():
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(ids, **kwargs)
        if cuda:
            torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000.0


def _forward_kwargs(model) -> dict:
    kwargs = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    return kwargs


MAX_ROUNDS_FACTOR = 4  # an undecided format is timed for up to this many times search.latency_repeats rounds


LOOK_ERROR = 0.05  # one-sided error of a decision over all its looks (Bonferroni: an equal share per look)


def median_interval(values: list[float], tail: float = LOOK_ERROR / MAX_ROUNDS_FACTOR) -> tuple[float, float, float]:
    """quantlab.gate.stats.median_interval at the latency search's per-look error."""
    return _median_interval(values, tail)


def decide_speedup(ratios: list[float], min_speedup: float) -> str:
    """'faster', 'not faster' or 'undecided' for a format whose paired rounds gave these format / unquantized
    ratios: the median ratio's bounds against 1 - min_speedup. Called at most MAX_ROUNDS_FACTOR times per format
    (one look per batch of rounds), each bound at LOOK_ERROR / MAX_ROUNDS_FACTOR, so a format exactly at the
    threshold is called faster with probability at most LOOK_ERROR."""
    _, lo, hi = median_interval(ratios)
    bound = 1.0 - min_speedup
    if hi < bound:
        return "faster"
    if lo > bound:
        return "not faster"
    return "undecided"


def time_paired(reference, candidate, batch: int, tokens: int, repeats: int, min_speedup: float,
                warmup: int = 2) -> tuple[list[float], list[float], str]:
    """Paired rounds of the reference (unquantized) and candidate models on the same ids, in A B B A order, until
    decide_speedup decides or MAX_ROUNDS_FACTOR x repeats rounds were timed: (reference ms, candidate ms, decision;
    'undecided' when the rounds ran out)."""
    embed = reference.get_input_embeddings()
    device = embed.weight.device
    ids = _tokens(embed.num_embeddings, batch, tokens, device)
    cand_ids = ids.to(candidate.get_input_embeddings().weight.device)
    cuda = device.type == "cuda"
    ref_kw, cand_kw = _forward_kwargs(reference), _forward_kwargs(candidate)
    for _ in range(warmup):
        _time_once(reference, ids, ref_kw, cuda, device)
        _time_once(candidate, cand_ids, cand_kw, cuda, device)
    ref_ms, cand_ms = [], []
    decision = "undecided"
    while len(ref_ms) < MAX_ROUNDS_FACTOR * repeats:
        for i in range(repeats):
            pair = [(reference, ids, ref_kw, ref_ms), (candidate, cand_ids, cand_kw, cand_ms)]
            for model, x, kw, out in (pair if (len(ref_ms) + i) % 2 == 0 else pair[::-1]):
                out.append(_time_once(model, x, kw, cuda, device))
        decision = decide_speedup([c / r for c, r in zip(cand_ms, ref_ms, strict=True)], min_speedup)
        if decision != "undecided":
            break
    return ref_ms, cand_ms, decision


def _summary(times: list[float], batch: int, tokens: int) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"ms": statistics.median(times), "iqr_ms": [q[0], q[2]], "repeats": len(times), "batch": batch,
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


def _empty_cache(device) -> None:
    import torch

    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def per_weight_costs(none_ms: float, uniform_ms: dict[str, float], searched_weights: int,
                     min_speedup: float, decisions: dict[str, str] | None = None) -> tuple[dict[str, float], list[str]]:
    """(format -> ms per weight relative to the unquantized model, formats treated as not faster). `none` is 0.
    With decisions (time_paired's per format), a format is faster only when its decision says so; without, when its
    latency is at least min_speedup below none's."""
    costs, slow = {"none": 0.0}, []
    for name, ms in uniform_ms.items():
        faster = (decisions[name] == "faster" if decisions is not None
                  else ms <= (1.0 - min_speedup) * none_ms)
        if faster:
            costs[name] = (ms - none_ms) / searched_weights
        else:
            costs[name] = max(ms - none_ms, 0.0) / searched_weights
            slow.append(name)
    return costs, slow


def measure_latency(cfg: Config, ctx, path: Path) -> dict:
    """search.cost=latency: an evaluated export's latency in engine=torch (the uniform formats are timed paired
    with the unquantized model by latency_profile)."""
    s = cfg.search
    return measure_export(path, ctx.device, ctx.dtype, s.latency_batch, s.latency_tokens or cfg.eval.seq_len,
                          s.latency_repeats, cfg.model.device_map)


def latency_profile(sens: Sensitivity, choices: dict[str, Choice], ref, kv: str,
                    timings: dict[str, dict]) -> LatencyModel:
    """The unquantized model and every uniform format (exported; the exports are the search's own cached
    artifacts) timed in engine=torch, each format paired with the unquantized model (time_paired); each format's
    cost per weight from its median paired ratio.

    Args:
        sens: the search's sensitivity (config, context, groups and fixed parameters; exports the uniform formats).
        choices: choice name -> Choice.
        ref: the prepared unquantized model (quantlab.models.ModelRef).
        kv: the KV cache format of the uniform exports.
        timings: export path -> measurement, filled with each uniform export's (an evaluation reuses it).

    Returns:
        The latency model the frontier's costs come from.
    """
    import gc

    from quantlab.engines.torch_engine import load_exported
    from quantlab.models import load_model

    cfg, ctx, groups = sens.cfg, sens.ctx, sens.groups
    s = cfg.search
    batch, tokens = s.latency_batch, s.latency_tokens or cfg.eval.seq_len
    reference = load_model(ref, ctx.device, ctx.dtype, cfg.model.device_map)
    none_times: list[float] = []
    measured: dict[str, dict] = {}
    decisions: dict[str, str] = {}
    try:
        for name in choices:
            if name == "none":
                continue
            path = export_candidate(sens, uniform(groups, choices, name, sens.fixed_params), kv)
            model, plan = load_exported(Path(path), ctx.device, ctx.dtype, cfg.model.device_map)
            try:
                ref_ms, cand_ms, decision = time_paired(reference, model, batch, tokens, s.latency_repeats,
                                                        s.min_speedup)
            finally:
                del model
                gc.collect()
                _empty_cache(ctx.device)
            ratios = [c / r for c, r in zip(cand_ms, ref_ms, strict=True)]
            ratio, lo, hi = median_interval(ratios)
            none_times += ref_ms
            measured[name] = timings[str(path)] = {
                **_summary(cand_ms, batch, tokens), "kernels": plan.get("kernels"), "paired_none_ms":
                statistics.median(ref_ms), "ratio": ratio, "ratio_interval": [lo, hi], "decision": decision}
            decisions[name] = decision
    finally:
        del reference
        gc.collect()
        _empty_cache(ctx.device)
    measured = {"none": _summary(none_times, batch, tokens), **measured}
    none_ms = measured["none"]["ms"]
    # a format's latency as the unquantized median times its paired ratio: drift between formats' rounds cancels
    uniform_ms = {n: none_ms * m["ratio"] for n, m in measured.items() if n != "none"}
    per_weight, slow = per_weight_costs(none_ms, uniform_ms, sum(g.params for g in groups), s.min_speedup,
                                        decisions)
    log.info("search: latency of a %d x %d prefill in engine=torch, each format paired with the unquantized "
             "model: unquantized %.1f ms; %s", batch, tokens, none_ms,
             ", ".join(f"{n} x{m['ratio']:.3f} [{m['ratio_interval'][0]:.3f}, {m['ratio_interval'][1]:.3f}] over "
                       f"{m['repeats']} rounds: {m['decision']}" for n, m in measured.items() if n != "none"))
    return LatencyModel(none_ms, per_weight, measured, slow)
