"""The sweep summary read at 1280 px (issue 38, item 8): the verdict column in view without scrolling the page,
plot axes that show what differs, labels inside the axes, the Pareto front drawn where the legend names it, and each
run's wall time split into computed seconds and cache hits.

Real runs of the tiny model into a cache of their own: fp8 with KV cache none (everything computed), fp8 with KV
cache fp8 (its checkpoint a few hundred bytes larger, 0.05%; the tokenized data and the reference's blocks come from
the first run) and fp8 with KV cache none again (a cache hit). The speed figure's cases are the real H200 sweep of
tests/test_summary_speed.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FAST, REPO, chromium, read_json, run_api
from test_summary_speed import FASTER, _h200, _html, _md_table, _with_b1, _write_runs

RUNS = (("0_fp8_kv-none", "none"), ("1_fp8_kv-fp8", "fp8"), ("2_fp8_kv-none_again", "none"))


@pytest.fixture(scope="module")
def sweep(tiny_llama, tmp_path_factory):
    """The three runs, in order, and their summary (rows, summary.md, summary.html)."""
    from quantlab.report.sweep import summary_rows, write_summary

    root = tmp_path_factory.mktemp("summary_layout")
    runs = []
    for name, kv in RUNS:
        code = run_api(["+precision=fp8", f"kv_cache={kv}", f"model.path={tiny_llama}", f"cache_dir={root / 'cache'}",
                        *FAST], root / "sweep" / name)
        assert code in (0, 1)
        runs.append(root / "sweep" / name)
    rows = summary_rows(runs)
    md, html = write_summary(root / "out", runs, rows)
    return runs, {r["name"]: r for r in rows}, md, html


def _record(run: Path) -> dict:
    return read_json(run / "run.json")


def test_wall_time_is_split_into_computed_seconds_and_cache_hits(sweep):
    """The first run built everything (a new cache): all computed. The same run again read every artifact from the
    cache: its cache-hit steps are the ones whose run.json events all say "reused", their seconds its cache hits.
    The KV-cache fp8 run reused the tokenized data and the reference's blocks and built the rest."""
    runs, rows, md, html = sweep
    first, kv_fp8, again = (rows[name] for name, _ in RUNS)
    for row, run in zip((first, kv_fp8, again), runs, strict=True):
        record = _record(run)
        assert row["wall_time_s"] == record["wall_time_s"]
        assert row["computed_s"] + row["reused_s"] == pytest.approx(record["wall_time_s"], abs=0.011)
        assert row["steps"] == len(record["stage_seconds"])
        assert row["reused_s"] == pytest.approx(sum(record["stage_seconds"][n] for n in row["reused_steps"]),
                                                abs=0.011)
    assert first["reused_steps"] == [] and first["reused_s"] == 0 and first["computed_s"] == first["wall_time_s"]
    assert {e["action"] for e in _record(runs[2])["events"]} == {"reused"}  # the premise: a cache hit
    assert again["reused_steps"] == ["data:calib", "data:eval", "export", "audit", "evaluate:torch"]
    assert again["reused_s"] > 0  # (no comparison of seconds between runs: a loaded machine decides those)
    assert kv_fp8["reused_steps"] == ["data:calib", "data:eval", "reference"]
    header, cells = _md_table(md.read_text())
    assert "wall (s)" not in header and header[-2:] == ["computed (s)", "cache hits (s)"]
    parsed = _html(html)
    assert parsed.rows[0][-2:] == ["computed (s)", "cache hits (s)"]
    for row in (first, kv_fp8, again):
        hits = f"({len(row['reused_steps'])} of {row['steps']} steps)"
        want = [f"{row['computed_s']:.1f}", f"{row['reused_s']:.1f} {hits}"]
        assert next(c for c in cells if c[0] == row["name"])[-2:] == want
        html_row = next(r for r in parsed.rows[1:] if r[0] == row["name"])
        assert html_row[-2:] == [want[0], want[1].replace(" (", "(")]  # "0.6<br><small>(5 of 7 steps)</small>"
    saved = {r["name"]: r for r in json.loads((md.parent / "summary.json").read_text())}
    assert saved[again["name"]]["reused_steps"] == again["reused_steps"]


def test_a_run_without_step_timings_shows_its_wall_time_not_split(tmp_path):
    """A run stopped by a crash: run.json has its wall time but no step timings or events; the row says so."""
    from quantlab import rundir
    from quantlab.report.sweep import summary_rows, write_summary

    run = tmp_path / "crashed"
    run.mkdir()
    rundir.start(run, {"run": rundir.what_ran("fp8", "none", "torch", "m")})
    rundir.stopped(run, RuntimeError("boom"))
    (row,) = summary_rows([run])
    assert row["wall_time_s"] is not None and (row["computed_s"], row["reused_s"]) == (None, None)
    md, _html_path = write_summary(tmp_path / "out", [run], [row])
    _header, cells = _md_table(md.read_text())
    assert cells[0][-2:] == [f"{row['wall_time_s']:.1f} (wall, not split)", "-"]


def _axes_checks(fig, xs: list[float], ys: list[float]) -> None:
    """Every point inside the axes; every label inside the axes and clear of the others."""
    ax = fig.axes[0]
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    assert all(x0 < x < x1 for x in xs) and all(y0 < y < y1 for y in ys)
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    assert labels
    for ext in labels:
        assert box.x0 <= ext.x0 and ext.x1 <= box.x1 and box.y0 <= ext.y0 and ext.y1 <= box.y1, (ext, box)
    for i, a in enumerate(labels):
        assert not any(a.overlaps(b) for b in labels[i + 1:])


def _front_line(ax, label: str):
    """The drawn line the legend entry `label` stands for (its display vertices), asserting it is visible."""
    import numpy as np

    assert label in [t.get_text() for t in ax.get_legend().get_texts()]
    (line,) = [ln for ln in ax.lines if ln.get_label() == label]
    assert line.get_visible() and line.get_linestyle() == "--"
    pixels = ax.transData.transform(np.column_stack(line.get_data()))
    assert np.abs(np.diff(pixels, axis=0)).sum() > 50  # a line, not a point
    return line


def test_quality_vs_size_shows_what_differs(sweep):
    """The two checkpoint sizes are 0.05% apart: they sit together on a size axis from 0 to past the unquantized
    model's size (not spread across the plot), the ratio axis holds 1 (the reference) and every interval, and the
    labels of the three runs (two at one point) are inside the axes, none over another."""
    from quantlab.report import plots

    _runs, rows, _md, html = sweep
    rows = list(rows.values())
    sizes = sorted({r["size_bytes"] / 2**20 for r in rows})
    assert len(sizes) == 2 and sizes[1] / sizes[0] - 1 < 0.001  # the premise: 0.05% apart
    fig = plots.pareto_figure(rows)
    ax = fig.axes[0]
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    reference = rows[0]["size_bytes"] / rows[0]["size_vs_reference"] / 2**20
    assert x0 <= 0 and reference < x1 and (x1 - x0) > 2 * sizes[1]  # was 0.0005 MiB wide: 0.06% of the sizes
    assert y0 < 1.0 < y1 and y1 - y0 >= plots.MIN_RATIO_SPAN
    assert all(y0 < v < y1 for r in rows for v in r["ppl_ratio_ci"])
    apart = ax.transData.transform((sizes[1], 1.0))[0] - ax.transData.transform((sizes[0], 1.0))[0]
    assert 0 <= apart < 0.01 * ax.get_window_extent().width
    _axes_checks(fig, sizes, [r["ppl_ratio"] for r in rows])
    assert sorted(t.get_text() for t in ax.texts) == sorted(r["label"] for r in rows)
    assert not ax.yaxis.get_major_formatter().get_offset()  # no "+1" over the ticks
    plots._plt().close(fig)
    assert _html(html).images[0] == ("quality vs size", plots.pareto(rows))  # the figure the page shows


def test_the_pareto_front_is_drawn_when_the_legend_names_it(sweep, tmp_path):
    """Quality vs size: the front of this sweep is the two fp8 / KV none runs at one point (a line through them
    alone has no length); the real H200 sweep's front is fp8 and int4_awq. Either way the legend's front is a
    drawn dashed line through every run on the front. Quality vs speed: the legend shows a dashed line only where
    two runs or more are on the front."""
    from quantlab.report import plots
    from quantlab.report.sweep import summary_rows

    h200 = summary_rows(_write_runs(tmp_path / "h200", _h200()))
    for rows in (list(sweep[1].values()), h200):
        fig = plots.pareto_figure(rows)
        ax = fig.axes[0]
        line = _front_line(ax, plots.FRONT_LABEL)
        vertices = set(zip(*line.get_data(), strict=True))
        front = [r for r in rows if r["pareto"]]
        assert front and all((r["size_bytes"] / 2**20, r["ppl_ratio"]) in vertices for r in front)
        _axes_checks(fig, [r["size_bytes"] / 2**20 for r in rows], [r["ppl_ratio"] for r in rows])
        plots._plt().close(fig)
    speed_label = "Pareto front: no other run is both faster and closer"
    fig = plots.speed_figure(h200)  # fp8 alone on the speed front
    ax = fig.axes[0]
    handle = ax.get_legend().legend_handles[[t.get_text() for t in ax.get_legend().get_texts()].index(speed_label)]
    assert handle.get_linestyle() == "None" and not [ln for ln in ax.lines if ln.get_gid() == "speed-front"]
    _axes_checks(fig, [r["speed_b1"]["value"] for r in h200], [r["ppl_ratio"] for r in h200])
    plots._plt().close(fig)
    two = summary_rows(_write_runs(tmp_path / "two", _with_b1(_h200(), "1_int4_awq_kv-none", FASTER)))
    fig = plots.speed_figure(two)  # int4_awq now faster than fp8, fp8 still closer: both on the front
    ax = fig.axes[0]
    handle = ax.get_legend().legend_handles[[t.get_text() for t in ax.get_legend().get_texts()].index(speed_label)]
    (line,) = [ln for ln in ax.lines if ln.get_gid() == "speed-front"]
    assert handle.get_linestyle() == "--" and len(set(zip(*line.get_data(), strict=True))) == 2
    plots._plt().close(fig)


def test_the_summary_at_1280_px_in_headless_chromium(sweep):
    """At 1280 x 800 the page does not scroll sideways; the run table scrolls in its own box, and the run and
    verdict columns stay in view however far it is scrolled; the plot fits the page."""
    exe, sync_playwright = chromium()
    _runs, rows, _md, html = sweep
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(html.as_uri())
        page.wait_for_load_state("load")
        page_width = page.evaluate("document.scrollingElement.scrollWidth")
        boxes = {}
        for scrolled in (False, True):
            if scrolled:
                page.evaluate("() => { const w = document.querySelector('#runs-wrap');"
                              " if (w) w.scrollLeft = w.scrollWidth; }")
            boxes[scrolled] = page.evaluate("""() => {
                const rect = e => { const r = e.getBoundingClientRect(); return [r.left, r.right, r.top, r.bottom]; };
                const wrap = document.querySelector('#runs-wrap') || document.body;
                return {wrap: rect(wrap), scroll: [wrap.scrollLeft, wrap.scrollWidth, wrap.clientWidth],
                        verdict: [...document.querySelectorAll('#runs td.v')].map(e => [e.innerText, ...rect(e)]),
                        run: [...document.querySelectorAll('#runs td.run')].map(rect),
                        last: [...document.querySelectorAll('#runs td.reused')].map(rect),
                        img: [...document.images].map(e => [e.alt, e.naturalWidth, ...rect(e)])}; }""")
        visible = page.locator("#runs td.v").evaluate_all("els => els.map(e => e.checkVisibility())")
        (REPO / "test-artifacts").mkdir(exist_ok=True)
        page.screenshot(path=str(REPO / "test-artifacts" / "summary_1280.png"), full_page=True)
        browser.close()
    assert page_width <= 1280  # was 1390: the table pushed the verdict column to 1261-1337 px
    assert visible == [True] * len(rows)
    for scrolled, b in boxes.items():
        left, right = b["wrap"][:2]
        assert len(b["verdict"]) == len(rows) and right <= 1280
        for (text, v0, v1, *_), (r0, r1, *_) in zip(b["verdict"], b["run"], strict=True):
            assert text.startswith(("PASS", "FAIL")) and left <= r0 and r1 <= v0 + 1 and v1 <= right, (scrolled, b)
        if scrolled:  # the table is wider than the page: scrolled to its end, its last column is in view
            assert b["scroll"][0] > 0 and b["scroll"][1] > b["scroll"][2]
            assert all(left <= c0 and c1 <= right + 1 for c0, c1, *_ in b["last"])
    (alt, width, i0, i1, *_), *_ = boxes[False]["img"]
    assert alt == "quality vs size" and width > 100 and 0 <= i0 and i1 <= 1280
