"""+search=cheapest: the cheapest per-layer quantization that passes the gate, proven on the exported checkpoint.

1. Sensitivity. ModelOpt's AutoQuantize (gradient method) calibrates every allowed per-layer format once on the
   run's calibration set and scores each (layer group, format): the Fisher/Taylor estimate of the loss increase
   when that group alone takes that format. search.sensitivity=measured replaces the scores by the measured NLL
   increase of each group alone (bench/RESULTS.md: the gradient scores predict combinations better; they are the
   default). quantlab keeps the scores (search artifact, JSON) and the calibrated model (in memory, owned by the
   search's SearchRun through its Sensitivity; nothing is kept per process: a second search, in this process or
   another, reads the scores from the cache and calibrates again, deterministically, once it needs a new export;
   a caller that wants the calibrated model reused opens the search with open_search and hands its `sens` on).
2. Frontier. Per group, the lower convex hull of (cost, score) over its formats; all upgrades of all groups sorted
   by score saved per bit added to the model (the group's weights times the bits per weight). Prefix k of that
   list is candidate k: from every group at its cheapest format (k = 0) to every group unquantized. Predicted
   score and cost are known for each k without evaluating anything.
3. Verification. A candidate is exported (ModelOpt's unified HF checkpoint, MIXED_PRECISION when formats differ)
   and evaluated like any run: `engine.checkpoint=EXPORT`, the run's engine, data and sequential gate (base
   thresholds for every candidate: one quality bar). The next candidate is placed by interpolating the gate's
   normalized slack against the predicted score to where it crosses 0, between the evaluated candidates nearest
   the pass/fail boundary (with the unquantized model as the anchor: score 0, slack 1), kept in the middle half of
   the bracket of the cheapest pass and the dearest fail (so each evaluation removes at least a quarter of it),
   until they are `resolution_bits` apart or `max_evaluations` are spent.
4. The winner is the cheapest configuration that passed, chain or uniform; KV formats other than the first
   are tried on it last. Every export and every evaluation block is a cached artifact: a rerun, or a search with a
   stricter gate, re-evaluates nothing it has seen.

Costs (SearchConfig.cost) are bits per weight over the linear layers AutoQuantize can quantize (lm_head included at
16 bits, embeddings excluded): `bits` counts what the checkpoint stores (int4 codes plus one scale per group:
4 + scale bits/block; FP8 8 plus per-tensor scales; unquantized 16, the deployment dtype; per-input-channel AWQ
pre-quant scales and per-tensor scales are left out of the prediction and measured on the export, search.json's
stored_bits_measured: under 1% more on the test model); `aq_bits` counts as
AutoQuantize does (4 for any int4 group size, NVFP4 4.5, FP8 8, none 16); `latency` is measured engine=torch
latency of a prefill on this device (quantlab.search.latency: the unquantized model and each uniform format are timed, a
format's cost per weight is its uniform latency change spread over the searched weights; every evaluated candidate
is timed too and the winner is the fastest measured that passes and beats the unquantized model by
search.min_speedup; the resolution stop still counts stored bits).

The package by concern: frontier.py (the algebra, no torch), checks.py (what is refused before calibration),
sensitivity.py (AutoQuantize, the calibrated model, exports and their self-check), candidates.py (export and
evaluate a candidate), latency.py (timing, the latency model), this driver (one SearchRun), and
quantlab.search.report (search.json and the reports).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from quantlab.artifacts import write_json_atomic
from quantlab.config import Config
from quantlab.env import versions
from quantlab.errors import EXIT_GATE_FAILED, EXIT_OK
from quantlab.rundir import REPORT_FILES, SEARCH_FILES, RunResult, link, set_aside_previous
from quantlab.search import checks
from quantlab.search.candidates import evaluate_candidate
from quantlab.search.frontier import (
    Candidate,
    Choice,
    Evaluation,
    Group,
    LatencyModel,
    frontier,
    next_k,
    slack,
    uniform,
)
from quantlab.search.latency import latency_profile, measure_latency
from quantlab.search.report import search_document, write_search_reports
from quantlab.search.sensitivity import Sensitivity

log = logging.getLogger("quantlab")


@dataclass
class SearchRun:
    """One search in progress: its inputs (config, context, run directory, overrides), what calibration decided
    (choices, groups, scores, the frontier, the latency model) and what it has evaluated. It owns the calibrated
    model through `sens` (a Sensitivity): nothing outlives it in the process."""

    cfg: Config
    ctx: object  # quantlab.step.RunContext
    run_dir: Path
    argv: list[str]
    snapshot: dict  # the composed config, for run.json
    start: float  # time.time() at the start
    thresholds: dict  # the one quality bar (checks.check_gate_feasible)
    ref: object  # the prepared model (quantlab.models.ModelRef)
    choices: list[Choice]
    sens: Sensitivity  # the scores and the calibrated model
    groups: list[Group] = field(default_factory=list)
    fixed_params: int = 0  # lm_head weights, kept at 16 bits
    fixed_modules: list[str] = field(default_factory=list)
    scores_doc: dict = field(default_factory=dict)  # the sensitivity artifact's scores.json
    chain: list[Candidate] = field(default_factory=list)  # the frontier
    evaluations: list[Evaluation] = field(default_factory=list)
    latency: LatencyModel | None = None  # search.cost=latency
    timings: dict[str, dict] = field(default_factory=dict)  # export path -> measured latency (cost=latency)
    winner: Evaluation | None = None
    top_known: bool = False  # whether the last quantized frontier candidate was evaluated

    @property
    def kind(self) -> str:
        """search.cost: bits, aq_bits or latency."""
        return self.cfg.search.cost

    @property
    def by_name(self) -> dict[str, Choice]:
        """Choice name -> Choice."""
        return {c.name: c for c in self.choices}

    @property
    def kv_order(self) -> list[str]:
        """search.kv_cache without repeats: the first is every candidate's, the others are tried on the winner."""
        return list(dict.fromkeys(self.cfg.search.kv_cache))

    def cost_of(self, c: Candidate) -> float:
        """A candidate's cost in the unit of search.cost (latency: predicted ms)."""
        return {"bits": c.bits, "aq_bits": c.aq_bits, "latency": c.latency_ms}[self.kind]

    def span(self, a: Candidate, b: Candidate) -> float:
        """Stored bits between two candidates for the resolution stop (also under cost=latency)."""
        return abs(self.cost_of(a) - self.cost_of(b)) if self.kind != "latency" else abs(a.bits - b.bits)

    @staticmethod
    def measured_ms(e: Evaluation) -> float:
        """An evaluation's measured latency (inf when not measured)."""
        return e.latency["ms"] if e.latency else math.inf

    def evaluate(self, cand: Candidate, kv: str) -> Evaluation:
        """Export, evaluate (and under cost=latency time) one candidate; recorded in evaluations."""
        ev = evaluate_candidate(self.cfg, self.sens, cand, kv, self.run_dir, self.argv)
        if self.kind == "latency":
            ev.latency = self.timings.get(ev.export) or measure_latency(self.cfg, self.ctx, Path(ev.export))
            self.timings[ev.export] = ev.latency
        self.evaluations.append(ev)
        lat = (f", {ev.latency['ms']:.1f} ms measured ({cand.latency_ms:.1f} predicted)" if ev.latency else "")
        log.info("search: %s: %.3f bits (%.3f AutoQuantize bits)%s -> %s (slack %.3f, %d windows)", ev.label,
                 cand.bits, cand.aq_bits, lat, "PASS" if ev.passed else "FAIL", slack(ev.doc), ev.result.windows)
        return ev

    def next_position(self) -> int | None:
        """The next frontier position to evaluate (next_k) between the dearest fail and the cheapest pass; None when
        that bracket is closed (adjacent, resolution_bits apart, or nothing cheaper than a pass is left)."""
        chain, evaluations = self.chain, self.evaluations
        passing_ks = [e.candidate.k for e in evaluations if e.passed and e.candidate.k is not None]
        failing_ks = [e.candidate.k for e in evaluations if not e.passed and e.candidate.k is not None]
        lo = max(failing_ks, default=-1)
        best_pass = min((e for e in evaluations if e.passed), key=lambda e: self.cost_of(e.candidate), default=None)
        # the bracket's upper end: the cheapest chain pass, or the first chain candidate that costs as much as a
        # configuration off the chain that passed (uniform fp8), or past the end of the chain
        hi = min(passing_ks, default=len(chain))
        if best_pass is not None and best_pass.candidate.k is None:
            hi = min(hi, next((i for i, c in enumerate(chain) if self.cost_of(c) >= self.cost_of(best_pass.candidate)),
                              len(chain)))
        if hi - lo <= 1 or (hi < len(chain) and self.span(chain[hi], chain[lo]) <= self.cfg.search.resolution_bits):
            return None
        k = next_k(chain, [(e.candidate, e.doc) for e in evaluations], lo, hi, 0.0)
        if best_pass is not None and self.cost_of(chain[k]) >= self.cost_of(best_pass.candidate):
            return None  # the frontier has nothing cheaper than a configuration that already passed
        return k

    def best(self) -> Evaluation | None:
        """The cheapest passing evaluation (cost=latency: the fastest measured that beats the unquantized model by
        search.min_speedup); ties go to the larger slack."""
        passing = [e for e in self.evaluations if e.passed]
        if self.kind == "latency":  # the fastest measured; one not measured faster than unquantized is no win
            passing = [e for e in passing
                       if self.measured_ms(e) <= (1.0 - self.cfg.search.min_speedup) * self.latency.none_ms]
            return min(passing, key=lambda e: (self.measured_ms(e), -slack(e.doc)), default=None)
        return min(passing, key=lambda e: (self.cost_of(e.candidate), -slack(e.doc)), default=None)


def open_search(cfg: Config, run_dir: Path, snapshot: dict, argv: list[str]) -> SearchRun:
    """Everything before the first evaluation: an earlier run's files set aside, every check (exit 2 before
    calibration), the model and data, the sensitivity (AutoQuantize, or its cached scores), under cost=latency the
    latency model, and the frontier.

    Raises:
        QuantlabError: input refused (exit 2), before calibration.
    """
    from quantlab.graph import Executor
    from quantlab.models import quantized_in_dims
    from quantlab.pipeline import context
    from quantlab.stages import data, prepare

    start = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    set_aside_previous(run_dir, REPORT_FILES + SEARCH_FILES)
    checks.check_search_run(cfg)
    checks.check_search_config(cfg)
    thresholds = checks.check_gate_feasible(cfg)
    ctx = context(cfg)
    r = Executor(ctx, [prepare.step(ctx), data.step(ctx, data.CALIB), data.step(ctx, data.EVAL)])
    ref = r.value("prepare")
    checks.check_model(cfg, ref)
    choices = checks.choices_for(cfg, quantized_in_dims(ref))
    checks.check_choices_on_device(cfg, choices, ctx.device)
    r.value("data:calib")
    r.value("data:eval")
    run = SearchRun(cfg=cfg, ctx=ctx, run_dir=run_dir, argv=argv, snapshot=snapshot, start=start, thresholds=thresholds,
                    ref=ref, choices=choices, sens=Sensitivity(cfg, ctx, r, choices))
    run.groups, run.fixed_params, run.scores_doc = run.sens.load()
    run.fixed_modules = run.scores_doc["fixed_modules"]
    if run.kind == "latency":
        run.latency = latency_profile(run.sens, run.by_name, ref, run.kv_order[0], run.timings)
    run.chain = frontier(run.groups, run.by_name, run.kind, run.fixed_params, run.latency)
    log.info("search: %d layer groups, %d frontier candidates from %.2f to %.2f %s", len(run.groups), len(run.chain),
             run.cost_of(run.chain[0]), run.cost_of(run.chain[-1]),
             "ms (predicted)" if run.kind == "latency" else run.kind)
    return run


def run_search(cfg: Config, run_dir: Path, snapshot: dict, argv: list[str]) -> RunResult:
    """+search: sensitivity, frontier, evaluations of exports until the cheapest passing one is found (module
    docstring); writes search.json, report.md / report.html and run.json into run_dir.

    Returns:
        The RunResult: exit 0 with a winner, 1 when nothing quantized passes (or, under cost=latency, nothing
        passing is faster); doc is search.json's document.

    Raises:
        QuantlabError: input refused before calibration (exit 2).
    """
    return search(open_search(cfg, run_dir, snapshot, argv))


def search(run: SearchRun) -> RunResult:
    """Steps 1-4 of the module docstring on an opened search (open_search), then its documents and final line."""
    chain, budget, base_kv = run.chain, run.cfg.search.max_evaluations, run.kv_order[0]
    if len(chain) == 1:  # cost=latency: no allowed format is faster than the unquantized model on this device
        return finish(run)
    # 1. the cheapest candidate (every group at its cheapest format: uniform int4 at the model's block size)
    first = run.evaluate(chain[0], base_kv)
    # 2. uniform FP8, the usual safe choice, for comparison (and a point to interpolate from)
    fp8 = uniform(run.groups, run.by_name, "fp8", run.fixed_params, run.latency) if "fp8" in run.by_name else None
    if not first.passed and fp8 is not None and fp8.assignment != first.candidate.assignment and \
            len(run.evaluations) < budget:
        run.evaluate(fp8, base_kv)
    # 3. the frontier between the dearest fail and the cheapest pass
    reserve = min(len(run.kv_order) - 1, max(budget - 2, 0))  # evaluations kept for the KV formats tried last
    while not first.passed and len(run.evaluations) < budget - reserve:
        k = run.next_position()
        if k is None:
            break
        if k == len(chain) - 1:
            k = len(chain) - 2  # the last candidate is the unquantized model: evaluate the least quantized instead
            run.top_known = True
        run.evaluate(chain[k], base_kv)
        if run.top_known and not run.evaluations[-1].passed:
            break
    run.winner = run.best()
    # 4. cheaper KV formats on the winner (under cost=latency only if measured faster too)
    for kv in run.kv_order[1:] if run.winner is not None else []:
        if len(run.evaluations) >= budget:
            break
        ev = run.evaluate(run.winner.candidate, kv)
        if ev.passed and kv == "fp8" and (run.kind != "latency" or run.measured_ms(ev) < run.measured_ms(run.winner)):
            run.winner = ev
    return finish(run)


def _final_line(run: SearchRun) -> tuple[int, str]:
    """The exit code and what the final console line says."""
    winner, latency, cfg, run_dir = run.winner, run.latency, run.cfg, run.run_dir
    if winner is not None:
        lat = ""
        if winner.latency and latency:
            lat = (f", {winner.latency['ms']:.1f} ms per forward pass measured "
                   f"({winner.latency['ms'] / latency.none_ms:.2f}x the unquantized {latency.none_ms:.1f} ms)")
        return EXIT_OK, (f"search: {'fastest' if latency else 'cheapest'} passing configuration {winner.label}: "
                         f"{winner.candidate.bits:.2f} bits per weight "
                         f"({winner.candidate.aq_bits:.2f} as AutoQuantize counts){lat}, ppl ratio "
                         f"{winner.doc['metrics']['ppl_ratio']['value']:.3f}, "
                         f"top-1 {winner.doc['metrics']['top1_agreement']['value']:.3f}"
                         f", {len(run.evaluations)} evaluations -> {run_dir / 'winner'}")
    if latency is not None and len(run.chain) == 1:
        return EXIT_GATE_FAILED, (
            f"search: no allowed format is faster than the unquantized model in engine=torch on this device "
            f"(unquantized {latency.none_ms:.1f} ms; " +
            ", ".join(f"uniform {n} {m['ms']:.1f} ms" for n, m in latency.measured.items() if n != "none") +
            f"; min_speedup {cfg.search.min_speedup:.0%}), so no quantization is cheaper in latency "
            f"(evidence in {run_dir / 'report.md'})")
    if latency is not None and any(e.passed for e in run.evaluations):
        return EXIT_GATE_FAILED, (
            f"search: the configurations that pass the gate are not measured faster than the unquantized model "
            f"({latency.none_ms:.1f} ms) by search.min_speedup={cfg.search.min_speedup:.0%} "
            f"(evidence in {run_dir / 'report.md'})")
    return EXIT_GATE_FAILED, ("search: no quantization passes the gate: " + (
        "even the least quantized configuration fails" if run.top_known
        else f"none of the {len(run.evaluations)} evaluated configurations passes") +
        f" (evidence in {run_dir / 'report.md'})")


def finish(run: SearchRun) -> RunResult:
    """search.json, the reports, the winner link, run.json and the final line; the RunResult (doc: search.json)."""
    doc = search_document(run, time.time() - run.start)
    write_search_reports(run.run_dir, doc)
    if run.winner is not None:
        link(run.run_dir / "winner", Path(run.winner.export))
    code, what = _final_line(run)
    record = {"argv": run.argv, "config": run.snapshot, "versions": versions(), "exit_code": code,
              "wall_time_s": round(time.time() - run.start, 1), "search": {"evaluations": len(run.evaluations)}}
    write_json_atomic(run.run_dir / "run.json", record)
    print(f"quantlab: {what} in {time.time() - run.start:.0f} s")
    return RunResult(code, run.run_dir, doc, record)
