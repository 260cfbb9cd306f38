"""quantlab.progress with a deterministic clock: what is printed when, the ETA and where it comes from, AWQ's passes of
unequal cost; and where libraries' output goes (a real run log). No sleeps, no timing: these cannot flake."""
from __future__ import annotations

import io
import logging
import warnings

import pytest

from quantlab import progress


class Clock:
    """A clock that moves only when told."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def console(tty: bool = False):
    clock = Clock()
    out = io.StringIO()
    return progress.Console(stream=out, tty=tty, clock=clock, thread=False), clock, out


def test_plain_lines_every_10_s_then_every_30_s_and_nothing_for_short_tasks():
    c, clock, out = console()
    short = c.open(progress.Task("tokenizing", clock=clock))
    clock.now += 9
    assert c.tick() is None
    c.close(short)
    assert out.getvalue() == ""  # under 10 s: not a word
    t = c.open(progress.Task("calibration", clock=clock))
    printed = []
    for _ in range(240):  # 2 minutes, ticked twice a second
        clock.now += 0.5
        if c.tick() is not None:
            printed.append(clock.now - t.start)
    assert printed == [10, 20, 30, 40, 50, 80, 110]  # every 10 s in the first minute, then every 30 s
    c.close(t)
    assert out.getvalue().splitlines()[-1] == "  calibration: done in 2.0 min"


def test_terminal_redraws_one_line_in_place():
    c, clock, out = console(tty=True)
    c.open(progress.Task("export", clock=clock))
    clock.now += 12
    c.tick()
    clock.now += 0.5
    c.tick()
    assert out.getvalue().count("\r\x1b[K") == 2 and "\n" not in out.getvalue()
    c.clear()
    assert out.getvalue().endswith("\r\x1b[K")


def test_eta_from_the_measured_rate_and_from_the_estimate_with_its_basis():
    clock = Clock()
    t = progress.Task("evaluate", total=10, unit="windows", clock=clock)
    clock.now += 20
    assert t.line(clock.now) == "evaluate: 0/10 windows (0%), 20 s (no estimate yet)"
    t.advance(4)
    assert t.line(clock.now) == "evaluate: 4/10 windows (40%), 20 s, ~30 s left"
    est = progress.Task("reference", expected=100, basis="from earlier builds", clock=clock)
    clock.now += 30
    assert est.line(clock.now) == "reference, 30 s, ~70 s left (expected, from earlier builds)"
    clock.now += 100
    assert est.line(clock.now) == "reference, 2.2 min, over the ~1.7 min expected, from earlier builds"


def test_awq_passes_of_unequal_cost():
    """AWQ-lite: a statistics pass (1 plain pass) then a search pass costing 1 + 11 x share. Before the search pass
    has done a layer its ETA is the statistics pass's measured time scaled by the cost model; then its own rate; a
    layer that takes longer than the average so far raises the ETA at once."""
    clock = Clock()
    passes = [("AWQ activation statistics", 1.0), ("AWQ scale search (11 candidates per layer)", 11.0)]
    p = progress.PassProgress(passes, batches=2, layers=3, clock=clock)
    t = progress.Task("calibrating int4_awq", clock=clock, eta=p.eta)
    p.task = t
    assert t.left(clock.now) == (None, "")
    p.begin_pass()
    for batch in (1, 2):
        for layer in range(3):
            p.at(batch, layer)
            clock.now += 1  # 1 s per layer and batch: 6 s for the pass
    assert p.eta(t, clock.now) == pytest.approx(0 + 6 * 11)  # the rest of the pass is its last layer's remainder
    assert p.end_pass() == 6
    p.begin_pass()
    assert p.eta(t, clock.now) == pytest.approx(66)  # the statistics pass x 11
    clock.now += 5
    assert p.eta(t, clock.now) == pytest.approx(61)  # 5 s into the first layer: the estimate counts down
    clock.now += 15
    assert p.eta(t, clock.now) == pytest.approx(20 * 6 - 20)  # 20 s > the 11 s a layer should take: raised at once
    p.at(1, 1)
    assert p.eta(t, clock.now) == pytest.approx(20 * 5)  # one layer in 20 s: 5 more at that rate
    assert t.line(clock.now).startswith("calibrating int4_awq: pass 2/2 (AWQ scale search (11 candidates per "
                                        "layer)), batch 1/2, layer 2/3, 26 s, ~")
    clock.now += 50  # this layer is slower than the average so far
    assert p.eta(t, clock.now) == pytest.approx(50 * 5 - 50)


def test_more_passes_than_expected_still_report():
    clock = Clock()
    p = progress.PassProgress([("max calibration", 1.0)], batches=1, layers=2, clock=clock)
    for _ in range(2):
        p.begin_pass()
        p.at(1, 1)
        clock.now += 1
        p.end_pass()
    assert [name for name, _ in p.passes] == ["max calibration", "pass 2"] and p.seconds == [1, 1]


def test_a_step_inside_a_step_counts_its_own_time_only():
    c, clock, out = console()
    outer = c.open(progress.Task("export", clock=clock, separate=True))
    inner = c.open(progress.Task("calibration", clock=clock, separate=True))
    clock.now += 60
    c.close(inner)
    clock.now += 15
    c.close(outer)
    assert out.getvalue().splitlines()[-2:] == ["  calibration: done in 60 s",
                                                "  export: done in 15 s (and 60 s building what it needs)"]


def test_libraries_output_goes_to_the_run_log_and_warnings_to_one_line(tmp_path, capsys):
    """What ModelOpt prints, what transformers logs, Python warnings: none on the console, all in the run's log,
    the warnings counted for one summary line. quantlab's own lines still reach the console."""
    root = logging.getLogger()
    handler = logging.StreamHandler()  # a console, as Hydra configures one
    root.addHandler(handler)
    try:
        with progress.run_logging(tmp_path) as runlog:
            import transformers  # noqa: F401 - its logging is routed while a step runs

            with progress.library_output():
                print("Inserted 756 quantizers")
                logging.getLogger("transformers.modeling_utils").warning("`torch_dtype` is deprecated!")
                warnings.warn("old API", DeprecationWarning, stacklevel=1)
                logging.getLogger("quantlab").warning("quantlab: our own line")
            said = runlog.warnings.summary(runlog.path)
    finally:
        root.removeHandler(handler)
    err, out = capsys.readouterr().err, capsys.readouterr().out
    assert "quantlab: our own line" in err
    assert "Inserted" not in err + out and "deprecated" not in err + out and "old API" not in err + out
    log = (tmp_path / "quantlab.log").read_text()
    assert "Inserted 756 quantizers" in log and "torch_dtype" in log and "old API" in log
    assert said == f"libraries warned 2 times (transformers 1, DeprecationWarning 1): see {tmp_path / 'quantlab.log'}" \
        or said == f"libraries warned 2 times (DeprecationWarning 1, transformers 1): see {tmp_path / 'quantlab.log'}"
    assert not [h for h in root.handlers if str(tmp_path) in getattr(h, "baseFilename", "")]  # restored


def test_a_loop_is_reported_by_wrapping_its_iterable(monkeypatch):
    """progress.iterate: how the evaluation's reference and candidate loops report windows done and the ETA."""
    c, clock, out = console()
    monkeypatch.setattr(progress, "_console", c)
    seen = []
    for _ in progress.iterate(range(0, 10, 4), "reference", 10, "windows", 4):
        clock.now += 6
        seen.append(c.tick())
    assert seen == [None, "  reference: 4/10 windows (40%), 12 s, ~18 s left", None]
    assert c.tasks == [] and out.getvalue().splitlines()[-1] == "  reference: done in 18 s"


def test_the_evaluation_says_what_is_left_from_its_first_look():
    """A sequential evaluation's pace (quantlab.stages.evaluate._Pace): nothing before a look has computed, then the
    measured seconds per window times the windows left to the cap, on the step's line and on the lines of the blocks
    inside it; reused blocks cost nothing and do not set the pace."""
    from quantlab.stages.evaluate import _Pace

    pace = _Pace(96)
    assert pace.left() is None and pace.outlook(0) == ""
    pace.looked(8, 0.01, computed=False)  # read back from the cache
    assert pace.left() is None
    pace.looked(16, 80.0, computed=True)  # 8 new windows in 80 s
    assert pace.left() == pytest.approx(10.0 * 80)
    c, clock, out = console()
    step = c.open(progress.Task("torch evaluation", clock=clock, eta=lambda _t, now: pace.left()))
    step.outlook = pace.outlook
    clock.now += 30
    assert step.line(clock.now) == "torch evaluation, 30 s, ~13.3 min left"
    c.open(progress.Task("candidate", total=8, unit="windows", clock=clock))
    clock.now += 12
    line = c.tick()
    assert line.startswith("  candidate: 0/8 windows (0%), 12 s (no estimate yet); evaluation: 16/96 windows, "
                           "~13.3 min left if it reads all (measured 10 s a window)"), line
    pace.looked(96, 800.0, computed=True)
    assert pace.left() == 0 and pace.outlook(0) == ""
