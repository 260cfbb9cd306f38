"""Cost model: how long a stage's build took, recorded in its manifest, and predictions for the next one.

Every artifact build records `cost` = {machine, device, stage, variant, params, size, wall_time_s}:
- variant: what changes the algorithm (calibration algorithm, engine, precision),
- params: parameters of the model,
- size: the amount of data the build processes (tokens calibrated or evaluated, characters tokenized).

A prediction for a planned build uses the earlier builds of the same stage on the same machine and device,
preferring the same variant, and scales their time linearly in size and params (calibration and evaluation
are forward passes: linear in tokens and, for a fixed shape family, in parameters). It is a planning figure:
the plan says which earlier builds it came from.
"""
from __future__ import annotations

import platform
import statistics
from dataclasses import dataclass


def machine_id() -> str:
    """This machine's name in cost records."""
    return platform.node() or "unknown"


def work(device: str, variant: str, params: int | None = None, size: int | None = None) -> dict:
    """What a build's time depends on: device, variant (precision, engine), parameters and size (tokens or bytes)."""
    return {"device": device, "variant": variant, "params": params, "size": size}


def record(stage: str, wall_time_s: float, cost: dict) -> dict:
    """A cost record: the machine, the stage, the wall time and what the build's time depends on."""
    return {"machine": machine_id(), "stage": stage, "wall_time_s": wall_time_s, **cost}


@dataclass
class Estimate:
    """A predicted build time and where it comes from (rough when predicted from another variant)."""
    seconds: float | None
    basis: str  # where the figure comes from, for the plan's log
    rough: bool = False  # predicted from other variants (another precision or engine)

    @property
    def known(self) -> bool:
        """Whether a figure could be predicted."""
        return self.seconds is not None


def _scale(entry: dict, want: dict) -> float:
    factor = 1.0
    for dim in ("size", "params"):
        have, need = entry.get(dim), want.get(dim)
        if have and need:
            factor *= need / have
    return entry["wall_time_s"] * factor


def estimate(history: list[dict], stage: str, want: dict, machine: str | None = None) -> Estimate:
    """Predict the wall time of building `stage` with `want` (a work() dict) from earlier cost records."""
    machine = machine or machine_id()
    same = [c for c in history if c.get("stage") == stage and c.get("machine") == machine
            and c.get("device") == want.get("device") and isinstance(c.get("wall_time_s"), (int, float))]
    exact = [c for c in same if c.get("variant") == want.get("variant")]
    fitted = _fit([c for c in exact if c.get("params") == want.get("params")], want.get("size"))
    if fitted is not None:
        return fitted
    pool, how, rough = (exact, "of this variant", False) if exact else (same, "of other variants", True)
    if not pool:
        return Estimate(None, "no earlier build on this machine")
    seconds = statistics.median(_scale(c, want) for c in pool)
    return Estimate(seconds, f"{len(pool)} earlier build{'s' if len(pool) > 1 else ''} {how}, scaled linearly", rough)


def _fit(pool: list[dict], size: int | None) -> Estimate | None:
    """Least-squares fixed + per-unit time when earlier builds of this variant and model saw >= 2 sizes; a
    single size can only be scaled proportionally, which counts fixed costs (model load, generation) per token."""
    points = [(c["size"], c["wall_time_s"]) for c in pool if c.get("size")]
    if not size or len({x for x, _ in points}) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    if slope <= 0:
        return None
    fixed = max(0.0, my - slope * mx)
    return Estimate(fixed + slope * size, f"fit to {len(points)} earlier builds at {len({x for x, _ in points})} sizes "
                                          f"({fixed:.1f} s fixed + {slope * 1000:.2f} s per 1000)")


def device_label(device) -> str:
    """The device of cost records (type:name)."""
    return f"{device.type}:{device.name}"


def run_work(cfg, device, params: int | None, calib_tokens: int | None, eval_tokens: int | None,
             engine: str | None = None) -> dict[str, dict]:
    """The work() of each compute stage of one run; the pipeline records these, the plan predicts them."""
    dev = device_label(device)
    recipe = f"{cfg.precision.name}/kv={cfg.kv_cache.dtype}"
    engine = engine or cfg.engine.name
    return {"quantize": work(dev, recipe, params, calib_tokens),
            "export": work(dev, recipe, params),
            "reference": work(dev, "reference", params, eval_tokens),
            "evaluate": work(dev, f"{engine}:{recipe}", params, eval_tokens)}
