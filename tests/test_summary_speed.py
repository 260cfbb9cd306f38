"""Speed in the sweep summary (issue 26, item 3): each row's decode speedup over the unquantized model at batch 1
and at the largest batch, the fastest passing run beside the ship candidate, quality vs decode speed beside quality
vs size, and on a CPU (speed not measured) none of it but the reason, said once.

Speed cannot be measured on a CPU, so the measured rows come from a real GPU sweep: tests/data/h200_default_sweep.json
holds the run, metrics, gate and speed sections of the three runs of bench/results/h200-2026-12-01/default_sweep
(`python -m quantlab -m +precision=fp8,int4_awq,int8_sq` on one H200), copied unchanged. The CPU rows are a real
tiny run made here."""
from __future__ import annotations

import copy
import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import FAST, chromium, read_json, run_api

DATA = Path(__file__).resolve().parent / "data" / "h200_default_sweep.json"
HOSTILE = "<img src=x onerror=alert(1)>"
SPEED_HEADERS = ("decode × unquantized, B=1 [interval]", "decode × unquantized, largest batch [interval]")


def _h200() -> list[dict]:
    return json.loads(DATA.read_text())["runs"]


def _write_runs(root: Path, runs: list[dict]) -> list[Path]:
    """Run directories holding what each run recorded: metrics.json's sections, and run.json's checkpoint size and
    exit code (the summary reads the size from run.json)."""
    dirs = []
    for run in runs:
        d = root / run["name"]
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"exit_code": 0 if run["metrics.json"]["gate"]["passed"] else 1,
                                                "artifacts": {"export": {"safetensors_bytes":
                                                                         run["safetensors_bytes"]}}}))
        (d / "metrics.json").write_text(json.dumps(run["metrics.json"]))
        dirs.append(d)
    return dirs


def _fmt(entry: dict) -> str:
    lo, hi = entry["decode_speedup"]["ci"]
    return f"{entry['decode_speedup']['value']:.3f} [{lo:.3f}, {hi:.3f}]"


def _md_table(md: str) -> tuple[list[str], list[list[str]]]:
    """summary.md's run table: its header cells and its rows' cells, stripped."""
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in lines]
    return cells[0], cells[1:]


class _Html(HTMLParser):
    """The run table's cells (by row) and every image (alt, src) of summary.html."""

    def __init__(self):
        super().__init__()
        self.rows, self.images, self._cell = [], [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.images.append((dict(attrs).get("alt"), dict(attrs).get("src")))

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(self._cell.strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _html(path: Path) -> _Html:
    parser = _Html()
    parser.feed(path.read_text())
    return parser


def _summary(runs: list[Path], out: Path) -> tuple[list[dict], str, _Html]:
    from quantlab.report.sweep import summary_rows, write_summary

    rows = summary_rows(runs)
    md, html = write_summary(out, runs, rows)
    return rows, md.read_text(), _html(html)


def test_speed_columns_are_the_speed_sections_numbers(tmp_path):
    """Every row reads the decode speedup at batch 1 and at the largest batch (16) with its interval from its
    metrics.json; summary.md, summary.html and summary.json show those numbers."""
    runs = _h200()
    rows, md, html = _summary(_write_runs(tmp_path / "sweep", runs), tmp_path / "out")
    by_name = {r["name"]: r for r in rows}
    header, cells = _md_table(md)
    col = [header.index(h) for h in SPEED_HEADERS]
    html_header = html.rows[0]
    html_col = [html_header.index(h) for h in SPEED_HEADERS]
    for run in runs:
        batches = {b["batch"]: b for b in run["metrics.json"]["speed"]["batches"]}
        assert sorted(batches) == [1, 16]
        row = by_name[run["name"]]
        for key, batch in (("speed_b1", 1), ("speed_bmax", 16)):
            assert row[key] == {"batch": batch, **batches[batch]["decode_speedup"]}, key
        assert row["speed_device"] == "NVIDIA H200" and row["speed_reason"] is None
        want = [_fmt(batches[1]), f"B=16: {_fmt(batches[16])}"]
        md_row = next(c for c in cells if c[0] == run["name"])
        assert [md_row[i] for i in col] == want
        html_row = next(r for r in html.rows[1:] if r[0] == run["name"])
        assert [html_row[i] for i in html_col] == want
    assert by_name["0_fp8_kv-none"]["speed_b1"]["value"] == pytest.approx(0.9416, abs=1e-4)  # RESULTS.md: 0.94
    saved = {r["name"]: r for r in json.loads((tmp_path / "out" / "summary.json").read_text())}
    assert all(saved[n]["speed_b1"] == by_name[n]["speed_b1"] for n in by_name)
    # the default rule is unchanged: the ship candidate of the real summary (bench/.../default_sweep/summary.md)
    assert "**Ship candidate: int4_awq, KV cache none, engine torch** (run 1_int4_awq_kv-none)" in md
    assert "same GPU (NVIDIA H200)" in md and "Speed was not measured" not in md


def test_the_plot_gains_a_quality_vs_speed_panel(tmp_path):
    """Quality vs size stays; quality vs decode speed at batch 1 is added: the three runs at their speedups with
    their intervals, all passed, and the front over (faster, closer) is fp8 alone (the fastest, and the closest)."""
    from matplotlib.collections import PathCollection

    from quantlab.report import plots

    rows, _md, html = _summary(_write_runs(tmp_path / "sweep", _h200()), tmp_path / "out")
    assert [alt for alt, _ in html.images] == ["quality vs size", "quality vs decode speed (batch 1)"]
    assert html.images[0][1] == plots.pareto(rows)
    assert html.images[1][1].startswith("data:image/png;base64,")
    fig = plots.speed_figure(rows)
    ax = fig.axes[0]
    assert ax.get_title() == "Quality vs decode speed (batch 1)"
    assert "decode speedup over the unquantized model at batch 1" in ax.get_xlabel()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["passed its gates", "Pareto front: no other run is both faster and closer",
                      "unquantized speed (1x)"]
    assert sorted(t.get_text() for t in ax.texts) == sorted(r["label"] for r in rows)
    rings = [tuple(c.get_offsets()[0]) for c in ax.collections if isinstance(c, PathCollection)]
    fp8 = next(r for r in rows if r["precision"] == "fp8")
    assert rings == [pytest.approx((fp8["speed_b1"]["value"], fp8["ppl_ratio"]))]
    plots._plt().close(fig)


def _with_b1(runs: list[dict], name: str, speedup: dict) -> list[dict]:
    out = copy.deepcopy(runs)
    run = next(r for r in out if r["name"] == name)
    run["metrics.json"]["speed"]["batches"][0]["decode_speedup"] = speedup
    return out


# Real intervals for the other two wordings (no run of that sweep decodes faster than bf16, nor has a decode interval
# that includes 1), put in place of fp8's batch-1 decode speedup:
# - faster: FP8 against bf16 at batch 1 at the Llama-3.1-8B shape on the same H200 (bench/results/h200-2026-12-01/
#   decode_run2.json, bench_fp8 vs bench_bf16): 5.4070 / 3.4436 ms = 1.570; the interval from the ranges of rounds,
#   [5.4043 / 3.4448, 5.4081 / 3.4345] (that bench records the ranges, not paired rounds).
# - no measurable difference: the fp8 run's own prefill speedup at batch 16, 0.598 [0.289, 1.088]. Its median is
#   below int4_awq's decode speedup (0.853), so that case summarizes the fp8 run alone.
FASTER = {"value": 5.406966670866935 / 3.443602531186996,
          "ci": [5.4043013049710185 / 3.4448434152910785, 5.4080598892704135 / 3.43450435515373]}
NO_DIFFERENCE = {"value": 0.598192074973648, "ci": [0.2886671541653235, 1.0877362006755853]}
SAYS = {"slower": "slower than the unquantized model (its whole interval is below 1)",
        "faster": "faster than the unquantized model (its whole interval is above 1)",
        "no measurable difference": "no measurable difference from the unquantized model (its interval includes 1)"}


@pytest.mark.parametrize("case", list(SAYS))
def test_the_fastest_passing_run_and_what_its_interval_says(case, tmp_path):
    """The ship candidate stays the smallest passing checkpoint on the quality/size front; one line adds the fastest
    passing run at batch 1 and what its interval says. The real sweep: fp8 is the fastest, 0.942 [0.941, 0.943],
    slower than the unquantized model."""
    from quantlab.report.render import md_escape
    from quantlab.report.sweep import headline

    runs, ship = _h200(), "int4_awq"
    if case == "faster":
        runs = _with_b1(runs, "0_fp8_kv-none", FASTER)
    elif case == "no measurable difference":
        runs, ship = [r for r in _with_b1(runs, "0_fp8_kv-none", NO_DIFFERENCE) if r["name"] == "0_fp8_kv-none"], "fp8"
    rows, md, _html_ = _summary(_write_runs(tmp_path / "sweep", runs), tmp_path / "out")
    fp8 = next(r for r in runs if r["name"] == "0_fp8_kv-none")["metrics.json"]["speed"]["batches"][0]
    line = (f"Fastest passing run at batch 1: fp8, KV cache none, engine torch (run {md_escape('0_fp8_kv-none')}), "
            f"decode {_fmt(fp8)} × the unquantized model: {SAYS[case]}.")
    assert line in md.splitlines()
    assert f"**Ship candidate: {ship}, KV cache none, engine torch**" in md  # the default rule, unchanged
    text = (tmp_path / "out" / "summary.html").read_text()
    fastest = re.search(r'<p id="fastest">(.*?)</p>', text, re.S).group(1)
    assert re.sub(r"</?b>", "", fastest) == line
    assert f", {case})" in headline(rows) and f"ship candidate {ship}" in headline(rows)
    if case == "slower":
        assert _fmt(fp8) == "0.942 [0.941, 0.943]"


def test_speed_verdict_needs_the_whole_interval_past_1():
    from quantlab.report.sweep import speed_verdict

    assert speed_verdict([1.001, 1.2]) == "faster"
    assert speed_verdict([0.8, 0.999]) == "slower"
    for ci in ([1.0, 1.2], [0.8, 1.0], [0.9, 1.1]):
        assert speed_verdict(ci) == "no measurable difference", ci


def test_no_passing_run_measured_means_no_fastest_line(tmp_path):
    """A run that failed its gates is never the fastest passing run, however fast."""
    runs = _with_b1(_h200(), "2_int8_sq_kv-none", FASTER)
    for run in runs:
        if run["name"] != "2_int8_sq_kv-none":
            run["metrics.json"]["speed"] = {"measured": False, "reason": "eval.speed=false"}
    failed = next(r for r in runs if r["name"] == "2_int8_sq_kv-none")["metrics.json"]["gate"]
    failed["passed"] = False  # as if its gate had failed
    rows, md, html = _summary(_write_runs(tmp_path / "sweep", runs), tmp_path / "out")
    assert "Fastest passing run" not in md and 'id="fastest"' not in (tmp_path / "out" / "summary.html").read_text()
    assert "Speed was not measured in 2 of 3 runs: eval.speed=false." in md.splitlines()
    assert [alt for alt, _ in html.images] == ["quality vs size", "quality vs decode speed (batch 1)"]


@pytest.fixture(scope="module")
def cpu_run(tiny_llama, shared_cache, tmp_path_factory):
    """A real run of the tiny model on the CPU: its metrics.json says speed was not measured, and why."""
    out = tmp_path_factory.mktemp("speed_cpu") / "0_fp8"
    assert run_api(["+precision=fp8", f"model.path={tiny_llama}", f"cache_dir={shared_cache}", "model.device=cpu",
                    *FAST], out) in (0, 1)
    return out


def test_a_cpu_sweep_has_no_speed_panel_and_says_why_once(cpu_run, tmp_path):
    """On a CPU no speed is measured: no speed numbers, no speed plot, no fastest line; the reason the run gave,
    once. The figures are what they were before speed existed: quality vs size alone, the same image."""
    from quantlab.report import plots

    speed = read_json(cpu_run / "metrics.json")["speed"]
    assert speed["measured"] is False and "GPUs only" in speed["reason"]
    sweep = tmp_path / "sweep"
    runs = [shutil.copytree(cpu_run, sweep / name, symlinks=True) for name in ("0_fp8", "1_fp8_again")]
    rows, md, html = _summary(runs, tmp_path / "out")
    assert all(r["speed_b1"] is None and r["speed_bmax"] is None and r["speed_reason"] == speed["reason"]
               for r in rows)
    header, cells = _md_table(md)
    for h in SPEED_HEADERS:
        assert all(c[header.index(h)] == "-" for c in cells)
        assert all(r[html.rows[0].index(h)] == "-" for r in html.rows[1:])
    from quantlab.report.render import md_escape

    assert md.count("Speed was not measured") == 1
    assert f"Speed was not measured in 2 of 2 runs: {md_escape(speed['reason'])}." in md.splitlines()
    assert "Fastest passing run" not in md and "Decode × unquantized" not in md
    assert plots.speed_pareto(rows) is None
    assert html.images == [("quality vs size", plots.pareto(rows))]


def test_the_size_figure_is_the_same_with_or_without_speed(tmp_path):
    """Quality vs size does not read speed: the same rows give the same image, byte for byte, whether their
    metrics.json has a speed section, one that was not measured, or none (a run from before speed existed); only a
    measured section adds the second figure."""
    from quantlab.report import plots

    measured = _h200()
    unmeasured = copy.deepcopy(measured)
    absent = copy.deepcopy(measured)
    for a, b in zip(unmeasured, absent, strict=True):
        a["metrics.json"]["speed"] = {"measured": False, "reason": "eval.speed=false"}
        del b["metrics.json"]["speed"]
    images = {}
    for name, runs in (("measured", measured), ("unmeasured", unmeasured), ("absent", absent)):
        _rows, md, html = _summary(_write_runs(tmp_path / name, runs), tmp_path / f"out_{name}")
        images[name] = html.images
    assert images["unmeasured"] == images["absent"] == [("quality vs size", images["measured"][0][1])]
    assert [alt for alt, _ in images["measured"]] == ["quality vs size", "quality vs decode speed (batch 1)"]
    assert "Speed was not measured" not in (tmp_path / "out_absent" / "summary.md").read_text()
    assert plots.speed_pareto([]) is None and plots.pareto([]) is None


def test_speed_strings_are_escaped_and_a_damaged_section_is_named(tmp_path):
    """The GPU's name and the reason are recorded strings: escaped in Markdown (|md) and HTML (autoescape). A speed
    section that is not what quantlab writes is named in the row's notes; the rest of the row is read."""
    runs = _h200()
    runs[0]["metrics.json"]["speed"]["device"] = HOSTILE
    runs[1]["metrics.json"]["speed"] = {"measured": False, "reason": HOSTILE}
    runs[2]["metrics.json"]["speed"]["batches"][1]["decode_speedup"]["ci"] = "wide"
    rows, md, _html_ = _summary(_write_runs(tmp_path / "sweep", runs), tmp_path / "out")
    html = (tmp_path / "out" / "summary.html").read_text()
    assert "<img src=x" not in md and "<img src=x" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in md and "&lt;img src=x onerror=alert(1)&gt;" in html
    damaged = next(r for r in rows if r["name"] == runs[2]["name"])
    assert damaged["speed_b1"] is None and damaged["verdict"] == "PASS"
    assert "metrics.json's speed section is damaged" in damaged["notes"]


def test_both_figures_render_in_headless_chromium(tmp_path):
    exe, sync_playwright = chromium()
    _summary(_write_runs(tmp_path / "sweep", _h200()), tmp_path / "out")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto((tmp_path / "out" / "summary.html").as_uri())
        page.wait_for_load_state("load")
        images = page.eval_on_selector_all("img", "els => els.map(e => [e.alt, e.naturalWidth])")
        fastest = page.inner_text("#fastest")
        browser.close()
    assert [alt for alt, _ in images] == ["quality vs size", "quality vs decode speed (batch 1)"]
    assert all(w > 100 for _, w in images)
    assert "slower than the unquantized model" in fastest
