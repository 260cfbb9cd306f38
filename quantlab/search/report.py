"""The search's documents: search.json (built from the search's state, a quantlab.search.driver.SearchRun) and
report.md / report.html rendered from it (the frontier plot embedded in report.html).

It reads the search through the SearchView protocol (the attributes it needs) and never imports the driver, which
imports this module.
"""
from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Protocol

from quantlab.artifacts import write_json_atomic, write_text_atomic
from quantlab.config import Config
from quantlab.env import versions
from quantlab.search.candidates import generations_gated, reproduce_argv
from quantlab.search.frontier import Candidate, Choice, Evaluation, Group, LatencyModel


class SearchView(Protocol):
    """What search.json is built from (quantlab.search.driver.SearchRun has it all)."""

    cfg: Config
    argv: list[str]
    thresholds: dict
    choices: list[Choice]
    groups: list[Group]
    fixed_params: int
    scores_doc: dict
    chain: list[Candidate]
    evaluations: list[Evaluation]
    latency: LatencyModel | None
    winner: Evaluation | None
    top_known: bool
    ref: object  # the prepared model (quantlab.models.ModelRef: its name)


def layer_map(groups: list[Group], assignment: dict[str, str]) -> dict:
    """Per decoder layer, the format of each group (named by its first member's last two name parts)."""
    rows: dict[str, dict[str, str]] = {}
    columns: list[str] = []
    for g in groups:
        parts = g.leader.removesuffix(".quant_recipe").split(".")
        layer = next((p for p in parts if p.isdigit()), "-")
        col = "+".join(m.split(".")[-1] for m in g.modules)
        if col not in columns:
            columns.append(col)
        rows.setdefault(layer, {})[col] = assignment[g.leader]
    return {"columns": columns, "rows": [{"layer": k, "formats": v} for k, v in rows.items()]}


def _latency_section(cfg: Config, latency: LatencyModel | None) -> dict | None:
    if latency is None:
        return None
    return {"batch": cfg.search.latency_batch, "tokens": cfg.search.latency_tokens or cfg.eval.seq_len,
            "repeats": cfg.search.latency_repeats, "min_speedup": cfg.search.min_speedup,
            "unquantized_ms": latency.none_ms, "measured": latency.measured,
            "per_weight_ms": latency.per_weight, "not_faster": latency.not_faster}


def search_document(run: SearchView, seconds: float) -> dict:
    """search.json: the search's inputs (gate, design, choices, sensitivity), its frontier, every evaluation's row,
    the winner (its per-layer formats and the command that reproduces its verdict alone) and the versions.

    Args:
        run: the search (a quantlab.search.driver.SearchRun, winner and top_known decided).
        seconds: the search's wall time so far.
    """
    cfg, winner = run.cfg, run.winner
    rows = [e.row() for e in run.evaluations]
    scores = run.scores_doc
    return {
        "schema": 1, "model": run.ref.name, "argv": run.argv, "wall_time_s": round(seconds, 1),
        "cost": cfg.search.cost, "thresholds": run.thresholds,
        "design": dataclasses.asdict(cfg.gate.statistical),
        "choices": [{"name": c.name, "bits": c.bits(), "aq_bits": c.aq_bits()} for c in run.choices],
        "sensitivity": {k: scores[k] for k in ("method", "seconds", "score_windows", "seq_len", "calib_windows",
                                               "measure_seconds", "spearman_vs_autoquantize") if k in scores},
        "groups": len(run.groups), "fixed_params": run.fixed_params,
        "frontier": [{"k": c.k, "bits": round(c.bits, 4), "aq_bits": round(c.aq_bits, 4), "predicted": c.predicted,
                      "latency_ms": c.latency_ms} for c in run.chain],
        "latency": _latency_section(cfg, run.latency),
        "evaluations": rows, "evaluations_used": len(run.evaluations), "max_evaluations": cfg.search.max_evaluations,
        "generations": generations_gated(cfg) and cfg.eval.gen_prompts > 0,
        "tokens_used": sum(r["tokens"] for r in rows),
        "winner": None if winner is None else {
            **winner.row(), "layer_map": layer_map(run.groups, winner.candidate.assignment),
            "reproduce": "python -m quantlab " + shlex.join(reproduce_argv(run.argv, Path(winner.export)))},
        "no_quantization_passes": winner is None, "least_quantized_evaluated": run.top_known,
        "versions": versions(),
    }


def write_search_reports(run_dir: Path, doc: dict) -> None:
    """search.json, report.md and report.html (with the frontier plot, quantlab.report.plots.search_frontier)."""
    from quantlab.report.plots import search_frontier
    from quantlab.report.render import environment

    write_json_atomic(run_dir / "search.json", doc)
    plot = search_frontier(doc)
    env = environment()
    ctx = {"doc": doc, "plot": plot, "winner": doc["winner"], "rows": doc["evaluations"]}
    write_text_atomic(run_dir / "report.md", env.get_template("search.md.j2").render(ctx))
    write_text_atomic(run_dir / "report.html", env.get_template("search.html.j2").render(ctx))
