"""Reports: Markdown and HTML from a real run; the HTML opened in headless Chromium (Debian's package)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import FAST, REPO, chromium, read_json, run_api

ARTIFACTS = REPO / "test-artifacts"
HOSTILE = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_llama, shared_cache):
    out = tmp_path_factory.mktemp("report_run")
    run_api(["+precision=int8_sq", f"model.path={tiny_llama}", f"cache_dir={shared_cache}", *FAST], out)
    return out


def test_markdown_report_verdict_first_and_short(run_dir):
    md = (run_dir / "report.md").read_text()
    doc = read_json(run_dir / "metrics.json")
    first = md.splitlines()[0]
    assert ("PASS" in first) == doc["gate"]["passed"] and "int8_sq" in first
    assert "| top1_agreement |" in md and "python -m quantlab" in md
    assert len(md) < 8000  # pasteable as a PR comment
    # what no check could see: a share of the text small enough to be absent from every window used
    design = doc["gate"]["design"]
    n = design["windows_used"]
    assert design["blind_share"] == pytest.approx(1 - 0.05 ** (1 / n))
    assert (1 - design["blind_share"]) ** n == pytest.approx(design["alpha"])
    assert f"less than {100 * design['blind_share']:.1f}% of the text's windows" in md
    assert f"absent from all {n} windows" in md


def _inject(run_dir: Path, out: Path) -> Path:
    """Re-render the report with hostile strings where model output, data and user input appear."""
    from quantlab.report.render import write_run_reports

    doc = read_json(run_dir / "metrics.json")
    for s in doc["generation"]["samples"]:
        s["candidate_rest"] = HOSTILE + s["candidate_rest"]
        s["prompt"] = "<img src=x onerror=alert(2)>" + s["prompt"]
    doc["run"]["model"] = "<b>model</b>" + HOSTILE
    doc["run"]["eval"]["source"] = HOSTILE
    doc["provenance"]["argv"] = ["+precision=int8_sq", f"eval.path={HOSTILE}"]
    out.mkdir(exist_ok=True)
    import numpy as np

    rows = doc["weight_error"]["weight_sqnr_worst"]  # the audit's rows the run kept (its five worst layers)
    assert rows
    for r in rows:
        r["module"] = HOSTILE + r["module"]
    write_run_reports(out, doc, np.asarray(doc["positions"]["kl_mean"]), rows)
    return out / "report.html"


def test_html_escapes_every_injected_string(run_dir, tmp_path):
    html = _inject(run_dir, tmp_path).read_text()
    assert "<script>" not in html and "onerror=alert" not in html.replace("onerror=alert(2)&gt;", "")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<img src=x" not in html
    md = (tmp_path / "report.md").read_text()
    outside_code = re.sub(r"```.*?```", "", md, flags=re.S)  # a fenced block shows HTML as text
    assert "<script>" not in outside_code and "<img" not in outside_code


def test_html_in_headless_chromium(run_dir, tmp_path):
    exe, sync_playwright = chromium()
    page_file = _inject(run_dir, tmp_path)
    console, requests, dialogs = [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu",
                                                               "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.on("console", lambda m: console.append((m.type, m.text)))
        page.on("pageerror", lambda e: console.append(("pageerror", str(e))))
        page.on("request", lambda r: requests.append(r.url))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(page_file.as_uri())
        page.wait_for_load_state("load")
        images = page.eval_on_selector_all("img", "els => els.map(e => [e.naturalWidth, e.alt])")
        text = page.inner_text("body")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        browser.close()
    assert dialogs == [], "a script from the data ran"
    assert [c for c in console if c[0] in ("error", "pageerror")] == []
    assert [u for u in requests if not u.startswith(("file:", "data:"))] == []
    assert len(images) >= 4 and all(w > 100 for w, _ in images)
    assert HOSTILE in text  # shown as text
    assert ("PASS" in text.split("\n")[1]) or ("FAIL" in text)


def test_sweep_summary_three_runs_and_rebuild(tiny_llama, tmp_path, shared_cache):
    import json
    import subprocess
    import sys

    from conftest import run_cli

    res = run_cli(["-m", "+precision=fp8,int8_sq,int4_awq", f"model.path={tiny_llama}", *FAST], cwd=tmp_path,
                  cache=shared_cache)
    assert res.returncode in (0, 1), res.stderr[-3000:]
    sweep = next((tmp_path / "outputs").glob("sweep_*"))
    rows = json.loads((sweep / "summary.json").read_text())
    assert len(rows) == 3
    for row in rows:
        doc = read_json(Path(row["run_dir"]) / "metrics.json")
        assert row["top1_agreement"] == doc["metrics"]["top1_agreement"]["value"]
        assert row["ppl_ratio"] == doc["metrics"]["ppl_ratio"]["value"]
        assert row["verdict"] == ("PASS" if doc["gate"]["passed"] else "FAIL")
        assert row["size_bytes"] > 0
    md = (sweep / "summary.md").read_text()
    assert len([line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| run ")]) == 3
    from quantlab.report.render import md_escape

    assert all(md_escape(row["precision"]) in md and (row["kv_cache"], row["engine"]) == ("none", "torch")
               for row in rows)
    assert "summary" in res.stdout
    # rebuilt elsewhere from the run directories alone
    out = tmp_path / "rebuilt"
    again = subprocess.run([sys.executable, "-m", "quantlab.summary", *[r["run_dir"] for r in rows], "--out", str(out)],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "summary.json").read_text()) == rows
    bad = subprocess.run([sys.executable, "-m", "quantlab.summary", str(tmp_path / "nothing")], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "not a directory" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "empty").mkdir()
    bad = subprocess.run([sys.executable, "-m", "quantlab.summary", str(tmp_path / "empty")], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "no run directories" in bad.stderr and "Traceback" not in bad.stderr
    try:
        exe, sync_playwright = chromium()
    except pytest.skip.Exception:
        return
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto((sweep / "summary.html").as_uri())
        assert page.locator("#runs tr").count() == 4
        assert page.inner_text("#recommendation")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "summary.png"), full_page=True)
        browser.close()
