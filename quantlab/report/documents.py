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
    shown_intervals(doc["metrics"], gate)
    if getattr(result, "numerics", None):
        doc["numerics"] = result.numerics
    return doc


# the digits the final line and the reports print of each headline metric, and their names there
PRINTED = {"top1_agreement": ("top-1", 3), "ppl_ratio": ("ppl ratio", 3), "kl_mean": ("KL", 4)}


def machine_dependent(doc: dict) -> dict[str, float]:
    """Headline metric -> the spread another machine's arithmetic gives it (metrics.json "numerics"), for those
    whose printed last digit that spread can change (spread at least half a unit of it)."""
    num = doc.get("numerics") or {}
    if not num.get("measured"):
        return {}
    out = {}
    for name, (_, digits) in PRINTED.items():
        spread = (num.get("metrics") or {}).get(name, {}).get("spread")
        if spread is not None and spread >= 0.5 * 10 ** -digits:
            out[name] = spread
    return out


def numerics_note(doc: dict) -> str:
    """One sentence on which printed digits depend on the machine, and why; "" when none do or it was not
    measured."""
    num, moved = doc.get("numerics") or {}, machine_dependent(doc)
    if not num.get("measured"):
        return num.get("served", "")  # engine=served: what its KL bound leaves open (evaluate._served_note)
    if not moved:
        return (f"Numerics: last-bit perturbations of every linear layer's input ({num['windows']} windows evaluated "
                "again) move no printed digit: these figures are the same on another CPU or GPU arithmetic.")
    parts = ", ".join(f"{PRINTED[k][0]} ±{v:.2g}" for k, v in moved.items())
    return (f"Numerics: another machine's arithmetic moves {parts} ({num['windows']} windows evaluated again with "
            "last-bit perturbations of every linear layer's input: quantizing activations turns the last-bit "
            "differences of other matrix kernels into other roundings); printed digits finer than that depend on "
            "the CPU or GPU that ran them, the verdict does not unless a margin is that small.")


def shown_intervals(metrics: dict, gate: dict) -> None:
    """One interval per metric, the one every report and the console show (metrics[name]["interval"], with
    "interval_basis"): a gated metric's is the interval its gate check decided with (documents as clusters, at the
    look's spent level); any other metric's its 95% interval with documents as clusters ("ci95")."""
    for c in gate.get("checks", []):
        m = metrics.get(c.get("metric"))
        if m is None or c.get("kind") != "threshold" or c.get("bucket") or len(c.get("ci") or []) != 2:
            continue
        if "interval" in m:  # a metric with two thresholds keeps its first check's interval
            continue
        level = f"{c['level']:.1%} two-sided" if c.get("level") else "exact"
        docs = f", {c['clusters']} documents as clusters" if c.get("clusters") else ""
        m["interval"] = [float(c["ci"][0]), float(c["ci"][1])]
        m["interval_basis"] = f"the gate's interval ({level}{docs}, {c.get('n', 0)} windows)"
    for m in metrics.values():
        if isinstance(m, dict) and "interval" not in m and m.get("ci95"):
            m["interval"], m["interval_basis"] = list(m["ci95"]), "95%, documents as clusters"


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
    rows = [("metric", "value", "interval (gate's where gated; else 95%; documents as clusters)")]
    for name in TABLE_METRICS:
        if name in m:
            ci = m[name].get("interval")
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
    note = numerics_note(doc)
    if note:
        lines.append(f"  {note}")
    return "\n".join(lines)
