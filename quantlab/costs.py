"""Cost model: how long a stage's build took, recorded in its manifest, and predictions for the next one.

Every artifact build records `cost` = {machine, device, stage, variant, params, size, wall_time_s}:
- variant: what changes the algorithm (calibration algorithm, engine, precision),
- params: parameters of the model,
- size: the amount of data the build processes (tokens calibrated or evaluated, characters tokenized).

A prediction for a planned build uses the earlier builds of the same stage on the same machine and device,
preferring the same variant, and scales their time linearly in size and params (calibration and evaluation
are forward passes: linear in tokens and, for a fixed shape family, in parameters). It is a planning figure:
the plan says which earlier builds it came from.

A precision with no build of its own yet is predicted from another precision's builds through an a-priori cost model
of calibration, counted in plain forward passes over the calibration tokens (`calibration_passes`): max calibration
(FP8, NVFP4) and SmoothQuant are one pass; AWQ-lite is one pass collecting activation statistics, then a search pass
in which every quantized linear layer runs once unquantized and once per candidate scale (11 for alpha_step 0.1),
so it costs 1 + (1 + 11 s) passes, s being the share of a pass spent in those layers (from the model's shape:
`linear_share`). AWQ therefore scales with layers x grid x tokens where FP8 scales with layers x tokens. The model
was checked against real builds on the 2-core CPU of the project (bench/RESULTS.md, "Plan estimates").
"""
from __future__ import annotations

import platform
import statistics
from dataclasses import dataclass


def machine_id() -> str:
    """This machine's name in cost records."""
    return platform.node() or "unknown"


def work(device: str, variant: str, params: int | None = None, size: int | None = None,
         passes: float | None = None, units: dict | None = None) -> dict:
    """What a build's time depends on: device, variant (precision, engine), parameters, size (tokens or bytes),
    for calibration its a-priori cost in plain forward passes (calibration_passes), which lets one precision's
    builds predict another's, and its work in machine units (quantlab.prior), which predicts a build on a machine
    that has none yet and scales one model's builds to another's."""
    out = {"device": device, "variant": variant, "params": params, "size": size}
    if passes is not None:
        out["passes"] = round(passes, 3)
    if units:
        out["units"] = units
    return out


# ------------------------------------------------------------------------------------- calibration model
# The calibration algorithm of each precision's ModelOpt preset (checked against ModelOpt's configs in the tests:
# tests/test_newcomer.py), so that planning never imports ModelOpt.
CALIBRATION = {"fp8": "max", "fp8_pc_pt": "max", "int8_sq": "smoothquant", "int4_awq": "awq_lite",
               "w4a8_awq": "awq_lite", "nvfp4": "max"}
AWQ_ALPHA_STEP = 0.1  # ModelOpt's awq_lite default (INT4_AWQ_CFG sets it explicitly)


def awq_grid(alpha_step: float = AWQ_ALPHA_STEP) -> int:
    """How many candidate scales awq_lite tries per layer: alpha in 0, step, ..., 1 (11 for 0.1)."""
    return int(round(1.0 / alpha_step)) + 1


def linear_share(config: dict | None, seq_len: int) -> float:
    """A-priori share of a calibration forward pass spent in the decoder's linear layers: their multiply-adds per
    token against those of attention over a causal window of seq_len (logits are skipped during calibration).
    0.9 when the config does not say enough (typical of small and mid-size decoders at 512 tokens)."""
    text = (config or {}).get("text_config") if isinstance((config or {}).get("text_config"), dict) else (config or {})
    hidden, inter = text.get("hidden_size"), text.get("intermediate_size")
    heads = text.get("num_attention_heads")
    if not (isinstance(hidden, int) and isinstance(inter, int) and isinstance(heads, int) and heads > 0):
        return 0.9
    head_dim = text.get("head_dim") or hidden // heads
    kv = text.get("num_key_value_heads") or heads
    linear = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inter  # q, o, k, v; gate, up, down
    attention = 2 * heads * head_dim * (seq_len / 2)  # QK^T and AV over the average causal context
    return linear / (linear + attention)


def calibration_passes(algorithm, share: float) -> list[tuple[str, float]]:
    """The forward passes a ModelOpt calibration algorithm makes over the calibration data, each with its a-priori
    cost in plain forward passes. algorithm: the preset's "algorithm" entry (a name or {"method": ..., ...})."""
    method = algorithm.get("method") if isinstance(algorithm, dict) else algorithm
    if method in ("awq_lite", "awq", "awq_full"):
        step = algorithm.get("alpha_step", AWQ_ALPHA_STEP) if isinstance(algorithm, dict) else AWQ_ALPHA_STEP
        grid = awq_grid(step)
        passes = [("AWQ activation statistics", 1.0),
                  (f"AWQ scale search ({grid} candidates per layer)", 1.0 + grid * share)]
        if method != "awq_lite":
            passes.append(("AWQ clip search", 1.0 + share))
        return passes
    if method == "smoothquant":
        return [("SmoothQuant statistics", 1.0)]
    if method is None:
        return []
    return [("max calibration", 1.0)]


def searches(precision: str, tokens: int | None, seq_len: int, batch: int) -> float:
    """The candidates a calibration tries on each quantized linear layer: AWQ's scale search, every candidate scale
    on every calibration batch (ModelOpt's awq_lite); 0 for max calibration and SmoothQuant (one forward each)."""
    if CALIBRATION.get(precision) not in ("awq_lite", "awq", "awq_full") or not tokens:
        return 0.0
    windows = max(1, tokens // max(1, seq_len))
    return float(-(-windows // max(1, batch)) * awq_grid())


def precision_passes(precision: str, config: dict | None, seq_len: int) -> float | None:
    """A precision's calibration cost in plain forward passes on a model (None: not a calibrated precision)."""
    if precision not in CALIBRATION:
        return None
    return sum(w for _, w in calibration_passes(CALIBRATION[precision], linear_share(config, seq_len)))


def record(stage: str, wall_time_s: float, cost: dict, others_cpu: float | None = None) -> dict:
    """A cost record: the machine, the stage, the wall time and what the build's time depends on; others_cpu: the
    share of the machine's CPU other processes used meanwhile (busy_share), which idle_seconds() takes out."""
    out = {"machine": machine_id(), "stage": stage, "wall_time_s": wall_time_s, **cost}
    if others_cpu is not None:
        out["others_cpu"] = round(others_cpu, 3)
    return out


# ---------------------------------------------------------------------------------- builds on a busy machine
def cpu_sample() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process and its children) now, from
    /proc/stat; None where there is none (not Linux)."""
    import os

    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
        ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system


def busy_share(before: tuple[float, float] | None, wall_s: float) -> float | None:
    """The share of the machine's CPU capacity (all its cores) that other processes used since `before`
    (cpu_sample) over wall_s seconds; None when it cannot be known."""
    import os

    after = cpu_sample()
    if before is None or after is None or wall_s <= 0.5:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return min(1.0, max(0.0, others / (wall_s * (os.cpu_count() or 1))))


BUSY = 0.1  # others' share of the CPU above which a build counts as made on a busy machine


def busy_now() -> tuple[float, int] | None:
    """(load average over the last minute, CPUs) when other work keeps most of this machine's CPUs busy now (what a
    plan for an idle machine should warn of), else None."""
    import os

    try:
        load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    except (OSError, AttributeError):
        return None
    return (load, cpus) if load >= 0.75 * cpus else None


def idle_seconds(entry: dict) -> float:
    """A CPU build's wall time as on an idle machine: its measured time x (1 - the share of the CPU other processes
    took meanwhile): a build that had half the machine took about twice as long (fair sharing; a compute-bound
    build oversubscribed loses more, so this stays an upper figure). GPU builds and records without the share: as
    measured."""
    wall = float(entry["wall_time_s"])
    share = entry.get("others_cpu")
    if not isinstance(share, (int, float)) or share <= BUSY or not str(entry.get("device", "")).startswith("cpu"):
        return wall
    return wall * max(0.1, 1.0 - float(share))


APRIORI = "a-priori"  # how an a-priori Estimate's basis starts


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

    @property
    def apriori(self) -> bool:
        """Whether the figure is the cost model's alone (no earlier build on this machine predicts it)."""
        return self.basis.startswith(APRIORI)


def _passes_of(entry: dict) -> float | None:
    """A record's calibration passes; for records written before they were recorded, from its variant's precision
    ("int4_awq/kv=none") with the default linear share."""
    if entry.get("passes"):
        return entry["passes"]
    precision = str(entry.get("variant") or "").split("/")[0]
    return precision_passes(precision, None, 512) if entry.get("stage") == "quantize" else None


def _ratio(entry: dict, want: dict, dim: str) -> float:
    have, need = (_passes_of(entry), want.get(dim)) if dim == "passes" else (entry.get(dim), want.get(dim))
    return need / have if have and need else 1.0


def _scale(entry: dict, want: dict) -> float:
    """entry's wall time scaled to want: linearly in size, parameters and calibration passes. Where the record knows
    how much of it the calibration passes took (pass_seconds), only those scale with size and passes; the rest (model
    load, setup) scales with parameters alone."""
    params = _ratio(entry, want, "params")
    passes = _ratio(entry, want, "passes")
    size = _ratio(entry, want, "size")
    in_passes = entry.get("pass_seconds")
    if isinstance(in_passes, (int, float)) and 0 < in_passes <= entry["wall_time_s"]:
        return (entry["wall_time_s"] - in_passes) * params + in_passes * size * params * passes
    return entry["wall_time_s"] * size * params * passes


def estimate(history: list[dict], stage: str, want: dict, machine: str | None = None,
             speed: dict | None = None) -> Estimate:
    """Predict the wall time of building `stage` with `want` (a work() dict) from earlier cost records; with none,
    from the build's work units at this machine's measured speed (quantlab.prior), when both are known. Records of
    builds made on a busy machine (history(): idle_seconds) count as on an idle one, and the basis says so."""
    est = _estimate(history, stage, want, machine, speed)
    busy = sum("measured_s" in c for c in history if c.get("stage") == stage
               and c.get("machine") == (machine or machine_id()) and c.get("device") == want.get("device"))
    if est.known and busy and not est.apriori:
        est.basis += (f"; {busy} of this stage's earlier builds ran while other processes used the CPU, counted as "
                      "on an idle machine")
    return est


def _estimate(history: list[dict], stage: str, want: dict, machine: str | None, speed: dict | None) -> Estimate:
    machine = machine or machine_id()
    same = [c for c in history if c.get("stage") == stage and c.get("machine") == machine
            and c.get("device") == want.get("device") and isinstance(c.get("wall_time_s"), (int, float))]
    exact = [c for c in same if c.get("variant") == want.get("variant")]
    fitted = _fit([c for c in exact if c.get("params") == want.get("params")], want.get("size"))
    if fitted is not None:
        return fitted
    if exact:
        pool, how, rough = exact, "of this variant", False
    elif want.get("passes"):  # another precision's calibrations, through the cost model of each
        pool = [c for c in same if _passes_of(c)] or same
        how, rough = f"of other variants, scaled by the calibration cost model ({want['passes']:.1f} passes)", True
    else:
        pool, how, rough = same, "of other variants", True
    if not pool:
        return _apriori(stage, want, speed)
    other_model = not any(c.get("params") == want.get("params") for c in pool)
    if speed and want.get("units") and other_model:
        # another model's builds: scaled by the work of each (its vocabulary, layers and widths, not its parameter
        # count alone); records without work units cannot be, and the model's own a-priori figure is better
        scaled = [x for x in (_scale_units(c, want, stage, speed) for c in pool) if x is not None]
        if not scaled:
            return _apriori(stage, want, speed)
        return Estimate(statistics.median(scaled), f"{len(scaled)} earlier build{'s' if len(scaled) > 1 else ''} "
                        f"of another model {how}, scaled by the work of each (quantlab.prior)", True)
    if speed and want.get("units") and rough:
        # another precision's: by the a-priori seconds of each build's work (its passes, AWQ's fake-quantized
        # searches, its engine's speed); a record without work units linearly and by the precisions' factors
        # (a record of another size, an evaluation's block, holds none of the step's fixed seconds: linearly)
        scaled = [(_scale_units(c, want, stage, speed) if c.get("size") == want.get("size") else None)
                  or _scale(c, want) * _variant_ratio(c, want, stage, speed) for c in pool]
        return Estimate(statistics.median(scaled), f"{len(pool)} earlier build{'s' if len(pool) > 1 else ''} {how}, "
                        "scaled by the work of each and the precisions' speed (quantlab.prior)", True)
    seconds = statistics.median(_scale(c, want) for c in pool)
    return Estimate(seconds, f"{len(pool)} earlier build{'s' if len(pool) > 1 else ''} {how}, scaled linearly", rough)


def machine_speed(root, device, dtype) -> dict | None:
    """This machine's measured speed for a run's device and dtype (quantlab.prior.speed, kept in the cache root),
    None when it cannot be measured: what estimate() prices a-priori with. device: a quantlab.env.Device."""
    from quantlab import prior

    try:
        return prior.speed(root, device, dtype, f"{machine_id()}|{device_label(device)}")
    except Exception:  # noqa: BLE001 - advice only: an estimate never fails a run or a plan
        return None


def _apriori(stage: str, want: dict, speed: dict | None) -> Estimate:
    """A build no earlier build on this machine predicts: its work units at the machine's measured speed."""
    units = want.get("units")
    seconds = _prior_seconds(stage, units, want.get("variant"), want, speed) if units and speed else None
    if seconds is None:
        return Estimate(None, "no earlier build on this machine")
    return Estimate(seconds, f"{APRIORI}: the model's size at this machine's measured speed (quantlab.prior)", True)


def _prior_seconds(stage: str, units: dict, variant, want: dict, speed: dict) -> float | None:
    """quantlab.prior.seconds of units at a record's variant, on want's device type."""
    from quantlab import prior

    device = str(want.get("device") or "cpu").split(":")[0]
    return prior.seconds(stage, units, device, speed, variant=str(variant or ""))


def _variant_ratio(entry: dict, want: dict, stage: str, speed: dict) -> float:
    """How much longer want's work takes at want's precision than at entry's (quantlab.prior's factors: FP8
    emulated on a CPU, SmoothQuant's statistics); 1 where it cannot say."""
    mine = _prior_seconds(stage, want["units"], want.get("variant"), want, speed)
    theirs = _prior_seconds(stage, want["units"], entry.get("variant"), want, speed)
    return mine / theirs if mine and theirs else 1.0


def _scale_units(entry: dict, want: dict, stage: str, speed: dict) -> float | None:
    """entry's wall time scaled to want by the ratio of their a-priori seconds (both records carry units)."""
    if not entry.get("units"):
        return None
    have = _prior_seconds(stage, entry["units"], entry.get("variant"), want, speed)
    need = _prior_seconds(stage, want["units"], want.get("variant"), want, speed)
    return entry["wall_time_s"] * need / have if have and need else None


def history(store) -> list[dict]:
    """The cost records of every build in an artifact store (what estimate() predicts from); a calibration's record
    gains pass_seconds, the time its forward passes took (from its manifest's info)."""
    out = []
    for a in store.entries():
        cost = a.manifest.get("cost") if isinstance(a.manifest, dict) else None
        if not isinstance(cost, dict) or not isinstance(cost.get("wall_time_s"), (int, float)):
            continue
        idle = idle_seconds(cost)
        slower = cost["wall_time_s"] / idle if idle > 0 else 1.0
        if slower != 1.0:  # made on a busy machine: as on an idle one (what the plan predicts)
            cost = {**cost, "wall_time_s": round(idle, 3), "measured_s": cost["wall_time_s"]}
        passes = (a.manifest.get("info") or {}).get("calib_passes")
        if isinstance(passes, list) and passes:
            seconds = [p.get("seconds") for p in passes if isinstance(p, dict)]
            if seconds and all(isinstance(x, (int, float)) for x in seconds):
                cost = {**cost, "pass_seconds": round(sum(seconds) / slower, 3)}
        out.append(cost)
    return out


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
