"""The reports of a run its checkpoint's audit stopped: audit.json, report.md / report.html with the findings, and a
junit.xml with one failing test case per error (a CI reads the same verdict as the exit code)."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from quantlab.artifacts import write_json_atomic, write_text_atomic
from quantlab.report.render import environment


def write_audit_reports(run_dir: Path, report, model: str, precision: str, kv: str) -> None:
    """audit.json, report.md, report.html and junit.xml of a run stopped by its audit (report: an AuditReport)."""
    write_json_atomic(run_dir / "audit.json", report.to_dict())
    ctx = {"report": report.to_dict(), "model": model, "precision": precision, "kv": kv,
           "errors": [f.to_dict() for f in report.errors], "warnings": [f.to_dict() for f in report.warnings]}
    env = environment()
    write_text_atomic(run_dir / "report.md", env.get_template("audit.md.j2").render(ctx))
    write_text_atomic(run_dir / "report.html", env.get_template("audit.html.j2").render(ctx))
    name = f"quantlab.{precision}.kv-{kv}.audit"
    suite = ET.Element("testsuite", name=name, tests=str(len(report.errors)), failures=str(len(report.errors)),
                       errors="0")
    for f in report.errors:
        case = ET.SubElement(suite, "testcase", classname=name, name=f"audit.{f.check}")
        failure = ET.SubElement(case, "failure", message=f.message, type="audit")
        failure.text = (f"modules: {', '.join(f.modules)}\n{f.cause}"
                        + (f"\nin deployment: {f.consequence}" if f.consequence else "")
                        + (f"\nfix: {f.fix}" if f.fix else ""))
    root = ET.Element("testsuites")
    root.append(suite)
    write_text_atomic(run_dir / "junit.xml", ET.tostring(root, encoding="unicode", xml_declaration=True))
