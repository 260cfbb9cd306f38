"""The search's algebra, with nothing to compute on a model: the per-layer choices and their costs, the layer groups,
the frontier of candidates, the gate's normalized slack and where to evaluate next, and what an evaluation leaves
(its report row). Pure Python: importing it imports neither torch nor ModelOpt (tests/test_search.py checks the
frontier against brute force on synthetic scores).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from quantlab.gate.checks import decided_intervals
from quantlab.gate.metrics import METRICS
from quantlab.precisions import PRECISIONS


# ------------------------------------------------------------------------------------------- choices
@dataclass(frozen=True)
class Choice:
    """One per-layer option: a precision (None: unquantized) with a group size where the format has one."""

    precision: str | None
    block: int | None = None

    @property
    def name(self) -> str:
        """How search.formats and reports name it: int4_awq@64, fp8, none."""
        if self.precision is None:
            return "none"
        return f"{self.precision}@{self.block}" if self.block else self.precision

    def aq_bits(self) -> float:
        """AutoQuantize's count: the value width (NVFP4 4.5), no scales."""
        if self.precision is None:
            return 16.0
        return 4.5 if self.precision == "nvfp4" else float(PRECISIONS[self.precision].weight_bits)

    def bits(self) -> float:
        """Stored bits per weight: the value width plus one scale per block (per-tensor scales: ~0)."""
        if self.precision is None:
            return 16.0
        p = PRECISIONS[self.precision]
        block = self.block or p.fixed_block
        return p.weight_bits + (p.scale_bits / block if block else 0.0)

    def cost(self, kind: str) -> float:
        """Its cost in the unit of search.cost (bits or aq_bits)."""
        return self.bits() if kind == "bits" else self.aq_bits()


def choice_by_name(choices: list[Choice], name: str) -> Choice:
    """The Choice of that name."""
    return next(c for c in choices if c.name == name)


# ---------------------------------------------------------------------------------------- frontier
@dataclass
class Group:
    """A layer group AutoQuantize gives one format (q/k/v together, gate/up together, each other Linear alone)."""

    leader: str  # AutoQuantize's hparam name (first member + ".quant_recipe")
    modules: list[str]
    params: int
    scores: dict[str, float]  # choice name -> AutoQuantize score (0 for none)


@dataclass
class Candidate:
    """One configuration: a format per group, its two costs and its predicted score."""

    label: str
    assignment: dict[str, str]  # group leader -> choice name
    bits: float
    aq_bits: float
    predicted: float  # sum of the groups' scores
    k: int | None = None  # position on the frontier (None: a uniform comparison off it)
    latency_ms: float | None = None  # predicted engine latency (search.cost=latency only)


def totals(groups: list[Group], choices: dict[str, Choice], assignment: dict[str, str], fixed_params: int) -> tuple:
    """(bits, aq_bits, predicted score) of an assignment; fixed_params (lm_head) count at 16 bits."""
    n = sum(g.params for g in groups) + fixed_params
    bits = (sum(g.params * choices[assignment[g.leader]].bits() for g in groups) + 16 * fixed_params) / n
    aq = (sum(g.params * choices[assignment[g.leader]].aq_bits() for g in groups) + 16 * fixed_params) / n
    return bits, aq, sum(g.scores[assignment[g.leader]] for g in groups)


@dataclass
class LatencyModel:
    """search.cost=latency: the measured unquantized and uniform latencies and the cost per weight of each format
    derived from them (quantlab.search.latency)."""

    none_ms: float
    per_weight: dict[str, float]  # choice name -> ms per weight relative to none (0 for none)
    measured: dict[str, dict]  # "none" and each uniform format -> its timing (latency_profile: paired rounds)
    not_faster: list[str]  # formats not min_speedup faster than none when applied everywhere (cost clamped >= 0)

    def predict(self, groups: list[Group], assignment: dict[str, str]) -> float:
        """The unquantized latency plus each group's weights times its format's cost per weight."""
        return self.none_ms + sum(g.params * self.per_weight[assignment[g.leader]] for g in groups)


def unit_costs(choices: dict[str, Choice], cost: str, latency: LatencyModel | None) -> dict[str, float]:
    """Cost per weight of every choice in the unit of search.cost."""
    if cost == "latency":
        if latency is None:
            raise ValueError("search.cost=latency needs the measured latency model")
        return dict(latency.per_weight)
    return {name: c.cost(cost) for name, c in choices.items()}


def _hull(points: list[tuple]) -> list[tuple]:
    """The lower convex hull of a group's (cost, score, name) points, cheapest first (dominated points dropped)."""
    hull: list[tuple] = []
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if hull and p[1] >= hull[-1][1]:
            continue  # costs more and predicts no less loss: dominated
        while len(hull) >= 2:
            (c1, s1, _), (c2, s2, _) = hull[-2], hull[-1]
            # keep hull[-1] only if the drop per bit from hull[-2] to it beats the drop from it to p
            if (s1 - s2) / (c2 - c1) <= (s2 - p[1]) / (p[0] - c2):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def frontier(groups: list[Group], choices: dict[str, Choice], cost: str, fixed_params: int,
             latency: LatencyModel | None = None) -> list[Candidate]:
    """Candidates 0..K: every group at its cheapest format, then one hull upgrade at a time, the upgrades that save
    the most predicted loss per bit of the model first (an upgrade costs the group's weights times the bits it adds
    to each). Each candidate minimizes score + lambda * cost for some lambda, so no configuration of the same or
    lower cost predicts less loss (tests/test_search.py checks it against brute force)."""
    moves, start = [], {}
    unit = unit_costs(choices, cost, latency)
    for gi, g in enumerate(groups):
        hull = _hull([(unit[c], g.scores[c], c) for c in g.scores])
        start[g.leader] = hull[0][2]
        for (c1, s1, _), (c2, s2, name) in zip(hull, hull[1:], strict=False):
            moves.append(((s1 - s2) / ((c2 - c1) * g.params), -gi, g.leader, name))  # per bit of the model
    moves.sort(key=lambda m: (-m[0], -m[1]))
    chain, current = [], dict(start)
    for k in range(len(moves) + 1):
        if k:
            _, _, leader, name = moves[k - 1]
            current[leader] = name
        b, aq, pred = totals(groups, choices, current, fixed_params)
        ms = latency.predict(groups, current) if latency else None
        chain.append(Candidate(f"k{k}", dict(current), b, aq, pred, k, ms))
    return chain


def uniform(groups: list[Group], choices: dict[str, Choice], name: str, fixed_params: int,
            latency: LatencyModel | None = None) -> Candidate:
    """Every group at one format (a uniform configuration, off the frontier, for comparison)."""
    assignment = {g.leader: name for g in groups}
    b, aq, pred = totals(groups, choices, assignment, fixed_params)
    return Candidate(f"uniform {name}", assignment, b, aq, pred, None,
                     latency.predict(groups, assignment) if latency else None)


# ------------------------------------------------------------------------------- the gate's verdicts
def slack(doc: dict | None) -> float:
    """The gate's closest call, normalized: min over checks of (confidence bound to threshold) / (ideal to
    threshold). 1 = the unquantized model; 0 = on the threshold; negative = fails by that share. A run the
    checkpoint audit stopped (doc None: nothing evaluated) fails outright: -1."""
    if doc is None:
        return -1.0
    worst = math.inf
    for c in doc["gate"]["checks"]:
        spec = METRICS.get(c.get("metric") or "")
        ci, th = c.get("ci"), c.get("threshold")
        if spec is None or spec.ideal is None or not ci or th is None:
            continue
        span = abs(spec.ideal - th) or 1.0
        bound = ci[0] if c.get("op") == ">=" else ci[1]
        s = (bound - th) / span if c.get("op") == ">=" else (th - bound) / span
        worst = min(worst, s)
    return worst if worst < math.inf else (1.0 if doc["gate"]["passed"] else -1.0)


def next_k(chain: list[Candidate], evaluated: list[tuple[Candidate, dict | None]], lo: int, hi: int,
           target: float) -> int:
    """The next frontier position to evaluate, strictly between the dearest fail lo and the cheapest pass hi:
    where the slack, interpolated linearly in predicted score, reaches `target`."""
    pts = sorted({(c.predicted, slack(doc)) for c, doc in evaluated} | {(0.0, 1.0)})
    fails = [p for p in pts if p[1] < 0]
    passes = [p for p in pts if p[1] >= 0]
    if fails and passes:
        a = min(fails, key=lambda p: p[0])  # the failing point with the least predicted loss
        b = max((p for p in passes if p[0] < a[0]), key=lambda p: p[0], default=(0.0, 1.0))
    else:
        two = sorted(pts, key=lambda p: p[0])[:2] if not fails else [(0.0, 1.0), min(fails, key=lambda p: p[0])]
        b, a = two[0], two[-1]
    if a[0] == b[0] or a[1] == b[1]:
        want = (a[0] + b[0]) / 2
    else:
        want = b[0] + (target - b[1]) * (a[0] - b[0]) / (a[1] - b[1])
    k = next((i for i, c in enumerate(chain) if c.predicted <= want), len(chain) - 1)
    # safeguard (regula falsi can creep one candidate at a time along a flat stretch): stay in the middle half of
    # the bracket, so every evaluation removes at least a quarter of it
    margin = (hi - lo) // 4
    return min(max(k, lo + max(1, margin)), hi - max(1, margin))


# -------------------------------------------------------------------------------------- evaluations
@dataclass
class GateResult:
    """One gate evaluation of an exported candidate, as the search reads it (quantlab.search.candidates builds it
    from the RunResult of quantlab.pipeline.run_pipeline)."""

    exit_code: int
    run_dir: str
    doc: dict | None = field(default=None, repr=False)  # metrics.json's document; None: the audit stopped the run
    audit_errors: list[str] = field(default_factory=list)  # "[check] message" of each audit error (doc None)

    @property
    def passed(self) -> bool:
        """The gate's verdict (False, unevaluated, when the audit stopped the run)."""
        return self.doc is not None and bool(self.doc["gate"]["passed"])

    @property
    def windows(self) -> int:
        """Evaluation windows the gate used (0 when nothing was evaluated)."""
        return self.doc["run"]["eval"]["windows"] if self.doc is not None else 0

    @property
    def tokens(self) -> int:
        """Evaluated tokens (0 when nothing was evaluated)."""
        return self.doc["run"]["eval"]["tokens"] if self.doc is not None else 0


@dataclass
class Evaluation:
    """One candidate exported and evaluated: its label, the KV format, the export and the gate's result."""

    label: str
    candidate: Candidate
    kv: str
    export: str
    result: GateResult
    stored_bits: float | None = None  # bits per weight the export stores, measured (candidates.stored_bits)
    latency: dict | None = None  # measured engine latency (search.cost=latency)

    @property
    def doc(self) -> dict | None:
        """The evaluation's metrics.json document (None: the audit stopped it)."""
        return self.result.doc

    @property
    def passed(self) -> bool:
        """The gate's verdict on the export."""
        return self.result.passed

    def row(self) -> dict:
        """The search report's row: costs, formats per group count, verdict, slack, metrics with intervals."""
        res = self.result
        m = res.doc["metrics"] if res.doc is not None else {}
        checks = res.doc["gate"]["checks"] if res.doc is not None else []
        decided = decided_intervals(checks)
        counts: dict[str, int] = {}
        for name in self.candidate.assignment.values():
            counts[name] = counts.get(name, 0) + 1
        return {"label": self.label, "k": self.candidate.k, "kv_cache": self.kv, "bits": round(self.candidate.bits, 4),
                "aq_bits": round(self.candidate.aq_bits, 4), "predicted_score": self.candidate.predicted,
                "stored_bits_measured": self.stored_bits,
                "formats": counts, "verdict": "PASS" if self.passed else "FAIL", "slack": round(slack(res.doc), 4),
                # each metric's interval is the one its gate check decided with (documents as clusters, at the
                # deciding look's level); a metric the gate does not check shows its 95% interval over windows
                "metrics": {k: {"value": m[k]["value"], "ci": decided.get(k, m[k].get("ci95"))} if k in m else
                            {"value": None, "ci": None} for k in ("top1_agreement", "ppl_ratio", "kl_mean")},
                "failed": [c["name"] for c in checks if not c["passed"]] + [f"audit {e}" for e in res.audit_errors],
                "windows": res.windows, "tokens": res.tokens, "run_dir": res.run_dir,
                "export": self.export, "exit_code": res.exit_code,
                "latency_ms_predicted": self.candidate.latency_ms,
                "latency_ms": self.latency["ms"] if self.latency else None,
                "latency_iqr_ms": self.latency["iqr_ms"] if self.latency else None}
