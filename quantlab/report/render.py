"""Reports for reviewers: report.md (a pull-request comment) and report.html (self-contained, plots inline).

Jinja2 renders both; HTML autoescapes every value, Markdown escapes through |e, so a generated
`<script>` shows as text.
"""
from __future__ import annotations

import logging
import shlex
from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from quantlab.artifacts import write_text_atomic
from quantlab.metrics import METRICS
from quantlab.report.documents import TABLE_METRICS, fmt

log = logging.getLogger("quantlab")


def environment() -> Environment:
    env = Environment(loader=PackageLoader("quantlab.report", "templates"),
                      autoescape=select_autoescape(enabled_extensions=("html.j2",), default_for_string=True),
                      undefined=StrictUndefined, trim_blocks=False, lstrip_blocks=False)
    env.filters["num"] = fmt
    return env


def context(doc: dict, plots: list[tuple[str, str | None]] = ()) -> dict:
    gate = doc["gate"]
    return {"run": doc["run"], "gate": gate, "metrics": doc["metrics"], "provenance": doc["provenance"],
            "failed": [c for c in gate["checks"] if not c["passed"]], "baseline": gate.get("baseline"),
            "attribution": doc.get("attribution"), "generation": doc.get("generation"),
            "table_metrics": TABLE_METRICS, "definitions": {k: v.definition for k, v in METRICS.items()},
            "argv": " ".join(shlex.quote(a) for a in doc["provenance"].get("argv", [])), "plots": list(plots)}


def write_run_reports(run_dir: Path, doc: dict, kl_values, checkpoint: Path | None, original: Path) -> dict:
    from quantlab.report import plots
    from quantlab.report.sqnr import weight_sqnr

    sqnr = weight_sqnr(checkpoint, original) if checkpoint is not None else []
    figures = [("Perplexity per window", plots.ppl_per_window(doc["windows"])),
               ("Top-1 agreement and KL along the window", plots.along_position(doc["positions"])),
               ("Distribution of per-position KL", plots.kl_histogram(kl_values)),
               ("Weight SQNR per linear layer", plots.sqnr_bars(sqnr))]
    env = environment()
    ctx = context(doc, figures)
    write_text_atomic(run_dir / "report.md", env.get_template("report.md.j2").render(ctx))
    write_text_atomic(run_dir / "report.html", env.get_template("report.html.j2").render(ctx))
    worst = sorted(sqnr, key=lambda r: r["sqnr_db"])[:5]
    return {"weight_sqnr_worst": worst, "weight_sqnr_layers": len(sqnr)}
