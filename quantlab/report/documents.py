"""The documents a run leaves: metrics.json (versioned schema, MetricsDoc), junit.xml (one testcase per gate
check) and the console table. report.md / report.html are rendered from the same document (quantlab.report.render).
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, TypedDict

from quantlab.artifacts import write_json_atomic, write_text_atomic
from quantlab.gate.metrics import METRICS_SCHEMA, TABLE

TABLE_METRICS = tuple(TABLE)


class MetricsDoc(TypedDict, total=False):
    """metrics.json (schema quantlab.metrics/1)."""

    schema: str
    run: dict  # precision, kv_cache, engine, model, recipe, eval, checkpoint, forward batch counts
    metrics: dict  # name -> {value, higher_is_better, ci95?, ...}
    gate: dict  # thresholds, checks [{name, kind, metric, value, threshold, op, passed, margin}], passed, warnings
    windows: dict  # per-window arrays (baseline comparisons, plots)
    positions: dict
    generation: Any
    provenance: dict  # fingerprints, versions, device, dtype, config, argv
    behaviour: dict  # KL and delta-p distributions, flips (metrics.behaviour)
    buckets: list  # metrics per position bucket (metrics.buckets)
    attribution: dict
    weight_error: dict


def metrics_document(run: dict, result, gate: dict, provenance: dict, attribution: dict | None) -> MetricsDoc:
    """metrics.json of an evaluated run: run, metrics, gate, behaviour panel, buckets, per-window values, generations,
    provenance and attribution."""
    doc: MetricsDoc = {"schema": METRICS_SCHEMA, "run": run, "metrics": result.metrics, "gate": gate,
                       "behaviour": result.panel, "buckets": result.buckets, "windows": result.windows,
                       "positions": result.positions, "generation": result.generation, "provenance": provenance}
    if attribution:
        doc["attribution"] = attribution
    return doc


def write_metrics(run_dir: Path, doc: dict) -> Path:
    """Write metrics.json into run_dir (atomically)."""
    path = run_dir / "metrics.json"
    write_json_atomic(path, doc)
    return path


def write_junit(run_dir: Path, doc: dict) -> Path:
    """junit.xml: one test case per gate check, failing where the check failed."""
    checks = doc["gate"]["checks"]
    name = f"quantlab.{doc['run']['precision']}.kv-{doc['run']['kv_cache']}"
    suite = ET.Element("testsuite", name=name, tests=str(len(checks)),
                       failures=str(sum(not c["passed"] for c in checks)), errors="0")
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=name, name=c["name"])
        text = check_line(c)
        if c["passed"]:
            ET.SubElement(case, "system-out").text = text
        else:
            ET.SubElement(case, "failure", message=text, type=c["kind"]).text = c.get("detail", "")
    root = ET.Element("testsuites")
    root.append(suite)
    path = run_dir / "junit.xml"
    write_text_atomic(path, ET.tostring(root, encoding="unicode", xml_declaration=True))
    return path


def fmt(value: float) -> str:
    """A number for tables: 4 significant digits, - for None, inf / nan spelled out."""
    if value is None:
        return "-"
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"


def check_line(c: dict) -> str:
    """One check in words: value, interval, threshold, margin, minimum detectable effect, windows."""
    ci = c.get("ci") or []
    interval = f" [{fmt(ci[0])}, {fmt(ci[1])}]" if len(ci) == 2 else ""
    mde = f", MDE {c['mde']:.3g} {c.get('mde_unit', '')}".rstrip() if c.get("mde") is not None else ""
    docs = ""
    if c.get("clusters") is not None and c.get("icc") is not None:
        docs = f", {c['clusters']} documents, ICC {c['icc']:.2f}, design effect {c['design_effect']:.2f}"
    return (f"{c['metric']} = {fmt(c['value'])}{interval} vs {c['op']} {c['threshold']:g}: {c.get('verdict', '')}"
            f" (margin {c['margin']:+.4g}{mde}, {c.get('n', 0)} windows{docs})")


def console_table(doc: dict) -> str:
    """The metrics table printed at the end of a run."""
    m = doc["metrics"]
    rows = [("metric", "value", "95% CI")]
    for name in TABLE_METRICS:
        if name in m:
            ci = m[name].get("ci95")
            rows.append((name, fmt(m[name]["value"]), f"[{fmt(ci[0])}, {fmt(ci[1])}]" if ci else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * wd for wd in widths))
    gate = doc["gate"]
    lines.append("")
    design = gate.get("design")
    if design:
        lines.append(f"gate: alpha {design['alpha']}, beta {design['beta']}, {design['spending']} spending; stopped at "
                     f"look {design['stopped_at_look']} of {len(design['looks'])} ({design['windows_used']} of up to "
                     f"{design['cap']} windows)")
    for c in gate["checks"]:
        mark = "PASS" if c["passed"] else "FAIL"
        lines.append(f"  [{mark}] {c['name']}: {check_line(c)}")
        if not c["passed"] and c.get("detail"):
            lines.append(f"         {c['detail']}")
    for w in gate["warnings"]:
        lines.append(f"  [warn] {w}")
    return "\n".join(lines)
