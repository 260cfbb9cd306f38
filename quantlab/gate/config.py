"""The gate's configuration schema: thresholds per metric (and per precision), the statistical design every
threshold is tested with, and an optional baseline. Registered in Hydra's ConfigStore as the `gate` node of
quantlab.config.Config; quantlab.gate.checks validates every key and value before any compute."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class Threshold:
    """One metric's bounds (min and / or max) and, optionally, the position bucket(s) it applies to; a tail check
    (kl_tail, ppl_tail, top1_tail) also names the per-window bound `above` whose exceedance share `max` bounds."""
    min: Optional[float] = None
    max: Optional[float] = None
    bucket: Optional[str] = None  # worst: every position bucket must pass (0-128, 128-512, 512-2k, ...); or one label
    above: Optional[float] = None  # tail checks: a window is bad when its mean value exceeds this


@dataclass
class StatisticalGate:
    """The statistical design every threshold is tested with (quantlab.gate.stats): one-sided alpha (passing a candidate
    that sits on the threshold), beta (failing one better than it by the reported minimum detectable effect), and
    the group-sequential looks: every `look_windows` windows up to the cap, Lan-DeMets alpha spending."""

    alpha: float = 0.05
    beta: float = 0.2
    sequential: bool = True  # false: one look at the cap (a fixed-n design)
    look_windows: int = 8
    spending: str = "pocock"  # pocock | obf | hsd (Hwang-Shih-DeCani with gamma)
    gamma: float = -2.0


@dataclass
class GateConfig:
    # metric -> Threshold fields (min / max / bucket). Plain dicts so a threshold on a new metric can be added from
    # the command line (++gate.thresholds.kl_p99.max=0.5); quantlab.gate.checks validates every key and value.
    """The gate: thresholds (common and per precision), the statistical design and an optional baseline."""
    thresholds: Dict[str, Any] = field(default_factory=dict)
    per_precision: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    statistical: StatisticalGate = field(default_factory=StatisticalGate)
    baseline: Optional[str] = None  # metrics.json of an earlier release: regression check
    baseline_alpha: float = 0.05
    # evaluation text that calibration also saw makes the verdict optimistic: a warning by default, a refusal (exit 2
    # before any evaluation) when true (gate=strict)
    refuse_calibration_overlap: bool = False
