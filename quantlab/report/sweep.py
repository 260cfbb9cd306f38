"""Sweep summary: one row per run, a recommendation, and quality vs size with the Pareto front.

Written by a Hydra callback when a multirun ends, and rebuildable from any run directories (made on any
machine) with `python -m quantlab.summary DIR [DIR ...]`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from hydra.experimental.callback import Callback

from quantlab.artifacts import write_json_atomic, write_text_atomic
from quantlab.errors import EXIT_INTERNAL
from quantlab.report.plots import pareto, pareto_front
from quantlab.report.render import environment

STATUS = "status.json"  # a run's exit code, written by the CLI into its run directory


def exit_codes(sweep_dir: Path) -> list[int]:
    """Exit code of every job of a sweep, read from each job's status.json (jobs may have run in other processes:
    joblib, submitit); a job that left none crashed before writing it."""
    codes = []
    for job in (p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()):
        status = job / STATUS
        try:
            codes.append(int(json.loads(status.read_text())["exit_code"]))
        except (OSError, ValueError, KeyError, TypeError):
            codes.append(EXIT_INTERNAL)
    return codes

log = logging.getLogger("quantlab")


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories (holding run.json) among paths and their immediate children."""
    runs = []
    for p in paths:
        if (p / "run.json").is_file():
            runs.append(p)
        elif p.is_dir():
            runs += sorted(c for c in p.iterdir() if (c / "run.json").is_file())
    return runs


def _row(run_dir: Path) -> dict:
    record = json.loads((run_dir / "run.json").read_text())
    metrics_file = run_dir / "metrics.json"
    doc = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
    cfg = record.get("config", {})
    ckpt = record.get("artifacts", {}).get("export", {})
    ref_path = Path(record.get("artifacts", {}).get("prepare", {}).get("path", "/nonexistent"))
    ref_bytes = sum(p.stat().st_size for p in ref_path.glob("*.safetensors")) if ref_path.is_dir() else None
    size = ckpt.get("safetensors_bytes")
    row = {"run_dir": str(run_dir.resolve()), "name": run_dir.name,
           "precision": (cfg.get("precision") or {}).get("name", "?"),
           "kv_cache": cfg.get("kv_cache", {}).get("dtype", "?"),
           "engine": cfg.get("engine", {}).get("name", "?"), "size_bytes": size,
           "size_vs_reference": (size / ref_bytes) if size and ref_bytes else None,
           "wall_time_s": record.get("wall_time_s"), "exit_code": record.get("exit_code")}
    row["label"] = f"{row['precision']}/kv-{row['kv_cache']}"
    if doc:
        m = doc["metrics"]
        row.update(top1_agreement=m["top1_agreement"]["value"], ppl_ratio=m["ppl_ratio"]["value"],
                   ppl_ratio_ci=m["ppl_ratio"].get("ci95"), kl_mean=m["kl_mean"]["value"],
                   verdict="PASS" if doc["gate"]["passed"] else "FAIL",
                   failed=[c["name"] for c in doc["gate"]["checks"] if not c["passed"]])
    else:
        audit = record.get("audit") or {}
        if audit.get("passed") is False:
            row.update(verdict="AUDIT FAIL", failed=[f"audit.{f['check']}" for f in audit.get("findings", [])
                                                     if f.get("severity") == "error"])
        else:
            row.update(verdict="ERROR" if record.get("exit_code") else "NOT EVALUATED", failed=[])
    return row


def recommend(rows: list[dict]) -> dict | None:
    """Smallest passing checkpoint on the Pareto front; ties go to the lower perplexity ratio."""
    passing = [r for r in rows if r["verdict"] == "PASS" and r.get("size_bytes")]
    if not passing:
        return None
    front = pareto_front([(r["size_bytes"], r["ppl_ratio"]) for r in passing])
    return min((passing[i] for i in front), key=lambda r: (r["size_bytes"], r["ppl_ratio"]))


def write_summary(out_dir: Path, run_dirs: list[Path]) -> tuple[Path, Path]:
    """summary.md, summary.html and summary.json of run directories: one row per run, the recommendation, the plot."""
    rows = [_row(d) for d in run_dirs]
    rows.sort(key=lambda r: (r["size_bytes"] or 0, r["label"]))
    evaluated = [r for r in rows if r.get("size_bytes") and r.get("ppl_ratio")]
    front = pareto_front([(r["size_bytes"], r["ppl_ratio"]) for r in evaluated])
    for i, r in enumerate(evaluated):
        r["pareto"] = i in front
    ctx = {"rows": rows, "best": recommend(rows), "plot": pareto(rows), "out_dir": str(out_dir)}
    env = environment()
    out_dir.mkdir(parents=True, exist_ok=True)
    md, html = out_dir / "summary.md", out_dir / "summary.html"
    write_text_atomic(md, env.get_template("summary.md.j2").render(ctx))
    write_text_atomic(html, env.get_template("summary.html.j2").render(ctx))
    write_json_atomic(out_dir / "summary.json", rows)
    return md, html


class SweepSummary(Callback):
    """Hydra callback: after a multirun, summarize every run of the sweep (the CLI reads the jobs' exit codes)."""

    def on_multirun_end(self, config, **_kwargs) -> None:
        """Write the sweep's summary once every job has ended."""
        sweep_dir = Path(config.hydra.sweep.dir)
        runs = find_runs([sweep_dir])
        if runs:
            md, html = write_summary(sweep_dir, runs)
            print(f"quantlab: sweep summary of {len(runs)} runs -> {html}")
