"""Speed in the verdict: what the checkpoint gains in serving speed and memory over the unquantized model, measured
in the same engine family on the same GPU in one run.

Measured (on CUDA only; elsewhere `not_measured` says why): for each batch size, the cached decode of both models
(quantlab.engines.decode: static KV cache, the step captured in a CUDA graph) over the same prompts, and one prefill
of the prompts, in paired rounds (candidate and reference alternating A B B A, so a GPU that warms up or throttles
slows both sides of a round alike). Each round gives decode ms/token and prefill tokens/s of both; the speedup is
the median over rounds of reference time / candidate time, with its distribution-free interval (order statistics,
5% each side: quantlab.gate.stats.median_interval). Memory: the bytes of each model's parameters and buffers on the
device (packed INT4 stays packed) and of each KV cache at each batch size (an FP8 cache is half of bf16's).
"""
from __future__ import annotations

import statistics
import time

from quantlab.gate.stats import median_interval

PROMPT = 128  # prompt tokens per sequence
STEPS = 32  # decode steps timed per round
ROUNDS = 7  # paired rounds per batch size (7: the interval is the range of rounds, ~98% two-sided)
BATCHES = (1, 16)


def not_measured(reason: str) -> dict:
    """The speed section of a run that did not measure speed, and why."""
    return {"measured": False, "reason": reason}


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def _one_round(decoder, prompts, steps: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) of one prefill and `steps` decode steps."""
    device = decoder.device
    _sync(device)
    start = time.perf_counter()
    decoder.prefill(prompts)
    _sync(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    _sync(device)
    return prefill, (time.perf_counter() - start) / steps


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _ratio(num: list[float], den: list[float]) -> dict:
    """The median over rounds of num / den with its order-statistic interval (5% each side)."""
    med, lo, hi = median_interval([a / b for a, b in zip(num, den, strict=True)])
    return {"value": med, "ci": [lo, hi]}


def measure_batch(engines: dict, batch: int, prompt: int = PROMPT, steps: int = STEPS, rounds: int = ROUNDS,
                  capture: bool | None = None) -> dict:
    """Paired rounds of the cached decode of engines {"candidate": e, "reference": e} at one batch size."""
    import torch

    from quantlab.engines import decode

    vocab = engines["reference"].model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch))
    decoders, times, info = {}, {name: ([], []) for name in engines}, {}
    try:
        for name, engine in engines.items():
            dec = decode.Decoder(engine.model, engine.head, engine.captured.take, batch, prompt + steps + 2,
                                 capture=capture)
            decoders[name] = dec
            _one_round(dec, prompts.to(dec.device), steps)  # warm-up: capture, kernels' first launches
            info[name] = dec.describe()
        order = list(engines)
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                prefill, per_token = _one_round(decoders[name], prompts.to(decoders[name].device), steps)
                times[name][0].append(prefill)
                times[name][1].append(per_token)
    finally:
        for dec in decoders.values():
            dec.close()
    cand, ref = times["candidate"], times["reference"]
    return {"batch": batch, "prompt": prompt, "steps": steps, "rounds": rounds,
            "decode_ms_per_token": {n: _summary([t * 1000 for t in times[n][1]]) for n in engines},
            "decode_tokens_per_s": {n: batch / statistics.median(times[n][1]) for n in engines},
            "prefill_tokens_per_s": {n: batch * prompt / statistics.median(times[n][0]) for n in engines},
            "decode_speedup": _ratio(ref[1], cand[1]), "prefill_speedup": _ratio(ref[0], cand[0]),
            "kv_cache_bytes": {n: info[n]["kv_cache_bytes"] for n in engines},
            "captured": {n: info[n]["captured"] for n in engines},
            "compiled": {n: info[n]["compiled"] for n in engines}}


def measure(candidate, reference, device, batches=BATCHES, capture: bool | None = None) -> dict:
    """The speed section of metrics.json: every batch size's paired measurement and both models' weight bytes."""
    out = {"measured": True, "device": device.name, "batches": [],
           "weights_bytes": {"candidate": _bytes(candidate.model), "reference": _bytes(reference.model)}}
    engines = {"candidate": candidate, "reference": reference}
    for batch in batches:
        out["batches"].append(measure_batch(engines, batch, capture=capture))
    out["path"] = path(out["batches"])
    return out


def path(batches: list[dict]) -> str:
    """Which decode path the timings ran, in words: the generations the verdict reads run the uncompiled cached
    decode (HFModelEngine.greedy), and so does this section, so its figures are the judged engine's (bench/decode.py
    times the compiled layers and says so)."""
    compiled = any(b["compiled"]["candidate"] for b in batches)
    captured = all(b["captured"]["candidate"] for b in batches)
    layers = "compiled layers (torch.compile)" if compiled else "uncompiled layers, the path of the generations"
    return f"{layers}, {'every step captured in a CUDA graph' if captured else 'steps not captured'}"


def describe(speed: dict | None) -> str:
    """One line for the console and the reports."""
    if not speed:
        return "speed: not measured"
    if not speed.get("measured"):
        return f"speed: not measured ({speed.get('reason', '')})"
    parts = []
    for b in speed["batches"]:
        d, s = b["decode_ms_per_token"], b["decode_speedup"]
        parts.append(f"decode B={b['batch']} {d['candidate']['median']:.2f} ms/token vs {d['reference']['median']:.2f} "
                     f"unquantized: x{s['value']:.2f} [{s['ci'][0]:.2f}, {s['ci'][1]:.2f}], prefill "
                     f"x{b['prefill_speedup']['value']:.2f}")
    w = speed["weights_bytes"]
    return (f"speed on {speed['device']} (paired rounds; {speed.get('path', 'CUDA graphs')}): " + "; ".join(parts)
            + f"; weights {w['candidate'] / 1e9:.3f} GB vs {w['reference'] / 1e9:.3f} GB")
