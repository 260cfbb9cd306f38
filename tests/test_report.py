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


# ------------------------------------------------------------------ issue 38 item 9: plots and Markdown for readers
EVIL_NAME = "m<img src=x onerror=alert(1)>|[x](javascript:alert(1))"


def _rows_210(worst: str = "model.layers.17.mlp.down_proj", fmt: str = "W8A8_SQ_PER_CHANNEL") -> list[dict]:
    """The audit's rows of a 30-layer model (SmolLM2-135M: 210 quantized linear layers), one layer far worse."""
    import numpy as np

    rng = np.random.default_rng(0)
    roles = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    rows = [{"module": f"model.layers.{i}.{r}", "format": fmt, "sqnr_db": float(30 + rng.normal(0, 0.8)),
             "cosine": 0.999, "gain": 1.0, "fold": None} for i in range(30) for r in roles]
    next(r for r in rows if r["module"] == worst)["sqnr_db"] = 19.2
    return rows


def _png_size(uri: str) -> tuple[int, int]:
    import base64
    import struct

    data = base64.b64decode(uri.split(",", 1)[1])
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_weight_sqnr_plot_is_bounded_and_names_the_worst_layer(run_dir, tmp_path):
    """210 quantized layers give a plot of the same height as 14 (not ~2,000 px of bars): SQNR by depth, a line per
    role, the audit's bound of the format drawn, the worst layer named with its SQNR."""
    import numpy as np

    from quantlab.audit.bounds import weight_bounds
    from quantlab.report import plots
    from quantlab.report.render import write_run_reports

    doc = read_json(run_dir / "metrics.json")
    heights = {}
    for n, rows in ((210, _rows_210()), (14, _rows_210()[:14])):
        write_run_reports(tmp_path, doc, np.asarray(doc["positions"]["kl_mean"]), rows)
        html = (tmp_path / "report.html").read_text()
        uri = re.search(r'<img alt="Weight SQNR[^"]*" src="([^"]+)"', html).group(1)
        width, heights[n] = _png_size(uri)
        assert width <= 1000, width
    assert heights[210] < 700 and abs(heights[210] - heights[14]) < 60, heights
    fig = plots.weight_sqnr_figure(_rows_210())
    ax = fig.axes[0]
    names = next(t.get_text() for t in ax.texts if t.get_gid() == "sqnr-worst-names")
    assert names.splitlines()[1].split() == ["1", "L17", "down_proj", "19.2", "dB"], names
    bound = weight_bounds("W8A8_SQ_PER_CHANNEL").sqnr_error_db
    assert [line.get_ydata()[0] for line in ax.lines if line.get_gid() == "sqnr-error-bound"] == [bound]
    roles = [line.get_label() for line in ax.lines if (line.get_gid() or "").startswith("sqnr-") and "bound" not in
             line.get_gid()]
    assert roles == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert ax.get_ylim()[0] < bound < 19.2 < ax.get_ylim()[1]


def test_markdown_reads_as_written_in_a_terminal(run_dir):
    """report.md is read raw (terminals, CI logs) as often as rendered: operators and version strings as written,
    no HTML entity and no backslash before a version's dot."""
    md = (run_dir / "report.md").read_text()
    doc = read_json(run_dir / "metrics.json")
    for entity in ("&gt;", "&lt;", "&amp;", "&#"):
        assert entity not in md, entity
    assert not re.search(r"\\[.)]", md), re.search(r".{20}\\[.)].{20}", md)
    versions = [f"{k} {v}" for k, v in doc["provenance"]["versions"].items() if v]
    assert versions and all(v in md for v in versions), (versions, md[-800:])
    checks = [c["name"] for c in doc["gate"]["checks"]]
    assert any(">=" in c for c in checks) and any("<=" in c for c in checks), checks
    assert all(f"| {c} |" in md for c in checks if "[" not in c), checks


def _table_breaks(md: str) -> list[str]:
    """Table lines whose cell count differs from their table's header (an unescaped | in a value)."""
    bad, header = [], None
    for line in md.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = len(re.findall(r"(?<!\\)\|", line))
        if header is None:
            header = cells
        elif cells != header:
            bad.append(line)
    return bad


def _markdown_tokens(md: str) -> list:
    """Every token a CommonMark renderer with GitHub's tables and strikethrough makes of md, inline ones too."""
    markdown_it = pytest.importorskip("markdown_it")
    tokens = []
    for t in markdown_it.MarkdownIt("commonmark").enable("table").enable("strikethrough").parse(md):
        tokens += [t, *(t.children or [])]
    return tokens


def _assert_nothing_injected(md: str, hostile: str) -> None:
    assert "<img" not in md and "<script" not in md and not re.search(r"(?<!\\)\]\(javascript", md)
    assert _table_breaks(md) == []
    tokens = _markdown_tokens(md)
    kinds = {t.type for t in tokens}
    assert not kinds & {"link_open", "image", "html_inline", "em_open", "s_open"}, kinds  # bold: the verdict's
    html_blocks = {t.content.strip() for t in tokens if t.type == "html_block"}
    assert html_blocks <= {"<details><summary>Provenance</summary>", "</details>"}, html_blocks  # the template's
    headings = [t for t in tokens if t.type == "heading_open"]
    assert all(t.tag in ("h2", "h3") for t in headings)
    text = "".join(t.content for t in tokens if t.type == "text")
    assert hostile in text  # shown as text, every character as written


def test_hostile_model_name_cannot_inject_into_the_markdown(tiny_llama, tmp_path, shared_cache):
    """A real run of a model whose directory name holds an HTML tag, a table pipe and a javascript: link: report.md
    shows the name as text (no tag, link, image, emphasis or table cell), rendered by a CommonMark renderer with
    GitHub's tables; so do a check name, a unit, an interval basis and a version string holding the same."""
    import shutil

    import numpy as np
    from conftest import compose

    from quantlab import api
    from quantlab.report.render import write_run_reports

    evil = tmp_path / EVIL_NAME
    shutil.copytree(tiny_llama, evil)
    cfg, _ = compose(["+precision=int8_sq", f"model.path={tiny_llama}", f"cache_dir={shared_cache}", *FAST])
    cfg.model.path = str(evil)  # the Python API takes a directory name no override grammar would
    assert api.run(cfg, tmp_path / "run").exit_code in (0, 1)
    md = (tmp_path / "run" / "report.md").read_text()
    _assert_nothing_injected(md, EVIL_NAME)
    doc = read_json(tmp_path / "run" / "metrics.json")
    assert doc["run"]["model"] == EVIL_NAME
    check = doc["gate"]["checks"][0]
    check["name"], check["mde_unit"] = f"{EVIL_NAME} >= 0.8", EVIL_NAME
    next(m for m in doc["metrics"].values() if isinstance(m, dict) and m.get("interval"))["interval_basis"] = EVIL_NAME
    doc["provenance"]["versions"]["torch"] = f"2.13.0 {EVIL_NAME}"
    doc["provenance"]["device"]["name"] = f"1. # > - {EVIL_NAME}"
    (tmp_path / "again").mkdir()
    write_run_reports(tmp_path / "again", doc, np.asarray(doc["positions"]["kl_mean"]),
                      [{"module": f"model.layers.0.{EVIL_NAME}", "format": "W8A8_SQ_PER_CHANNEL", "sqnr_db": 30.0}])
    md = (tmp_path / "again" / "report.md").read_text()
    _assert_nothing_injected(md, f"{EVIL_NAME} >= 0.8")
    text = "".join(t.content for t in _markdown_tokens(md) if t.type == "text")
    assert f"1. # > - {EVIL_NAME}" in text and f"2.13.0 {EVIL_NAME}" in text


@pytest.mark.parametrize("value", ["top1_agreement >= 0.8", "kl_tail <= 0.05 (windows above 0.5)", "torch 2.13.0",
                                   "2.13.0", "share of windows with mean kl > 0.5", "Q&A", "int8_sq", "-0.5", "#3"])
def test_md_escape_leaves_what_cannot_act_as_written(value):
    from quantlab.report.render import md_escape

    assert md_escape(value) == value


@pytest.mark.parametrize("value", [EVIL_NAME, HOSTILE, "<!-- x -->", "<http://evil.example>", "&lt;b&gt;", "&#60;",
                                   "[x]: http://evil.example", "![i](http://evil.example/x.png)", "**b** _i_ ~~s~~",
                                   "`code`", "1. item", "2) item", "# heading", "> quote", "- item", "+ item", "---",
                                   "===", "a | b", "x <", "x &", "a\\b"])
@pytest.mark.parametrize("where", ["{}", "text {} text", "> {}", "- {}"])
def test_md_escape_renders_the_value_as_text_wherever_it_lands(value, where):
    """Rendered by a CommonMark renderer, an escaped value at a line's start, inside a line, in a quote or a list
    item is one paragraph of text holding exactly its characters; in a table cell it is one cell."""
    from quantlab.report.render import md_escape

    tokens = _markdown_tokens(where.format(md_escape(value)))
    assert {t.type for t in tokens if t.nesting != -1} <= {"paragraph_open", "inline", "text", "blockquote_open",
                                                           "bullet_list_open", "list_item_open"}, tokens
    marker = where.partition("{}")[0] if where.startswith(("> ", "- ")) else ""  # the quote's or the item's own
    assert "".join(t.content for t in tokens if t.type == "text") == where.format(value).removeprefix(marker)
    table = _markdown_tokens(f"| a | b |\n|---|---|\n| {md_escape(value)} | z |\n")
    cells = [i for i, t in enumerate(table) if t.type == "td_open"]
    assert len(cells) == 2
    assert "".join(t.content for t in table[cells[0] + 1].children if t.type == "text") == value
