"""quantlab's own progress on stderr, and the libraries' chatter in the run's log file.

One mechanism for every long step: a `Task` (a label, optionally a total of units, an a-priori estimate) is opened
with `task(...)`; a background ticker renders the innermost open task. On a terminal it is one line redrawn in place
(twice a second); on anything else (CI logs, a pipe, a file) it is a plain line every 10 s during a task's first
minute and every 30 s after, so a long step is never silent for a minute and never floods a log. The ETA is honest
about where it comes from: the task's own measured rate once units are done (`~2.5 min left`), before that the
a-priori estimate it was opened with (`~3 min expected`), and it says when a step runs over its estimate.

`QUANTLAB_PROGRESS=off` silences it; `QUANTLAB_PROGRESS=lines` forces plain lines on a terminal.

Libraries (ModelOpt, transformers, accelerate) print, warn and draw their own progress bars. `run_logging(run_dir)`
sends their log records to the run's log file only (the console shows quantlab's own), `library_output()` routes
what they print to that log while a step runs, and `LibraryWarnings` counts their warnings for one summary line.
"""
from __future__ import annotations

import io
import logging
import os
import sys
import threading
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger("quantlab")
LIB = logging.getLogger("quantlab.lib")  # what libraries print while a step runs: the log file only
FIRST_MINUTE_EVERY, LATER_EVERY = 10.0, 30.0  # plain-line cadence (seconds) off a terminal
REDRAW_EVERY = 0.5  # terminal redraw cadence
REPORT_AFTER = 10.0  # tasks shorter than this print nothing at all (no "done" line either)


def duration(seconds: float) -> str:
    """Seconds for people: '8 s', '2.5 min', '1.2 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# ------------------------------------------------------------------------------------------------- tasks
@dataclass
class Task:
    """One long piece of work being reported: units done of a total (or none), and an a-priori estimate.

    eta: a function (task, now) -> seconds left, or None, for work whose units are not all alike (AWQ's passes);
    without it the ETA is the measured rate over the units done, else the estimate minus the time spent."""

    label: str
    total: int | None = None
    unit: str = ""
    expected: float | None = None  # a-priori seconds (cost model, earlier builds), None when there is none
    basis: str = ""  # where `expected` comes from, shown with it
    clock: Callable[[], float] = time.monotonic
    eta: Callable[[Task, float], float | None] | None = None
    done: float = 0
    detail: str = ""
    start: float = field(default=0.0)
    separate: bool = False  # a step of its own: its time is not its parent's (the done line says so)
    nested: float = 0.0  # seconds of separate tasks run inside this one
    outlook: Callable[[float], str] | None = None  # (now) -> text added to the lines of the tasks inside it

    def __post_init__(self):
        self.start = self.clock()

    def advance(self, n: float = 1, detail: str | None = None) -> None:
        """n more units done (detail: what is being done now, shown instead of done/total)."""
        self.done += n
        if detail is not None:
            self.detail = detail

    def left(self, now: float) -> tuple[float | None, str]:
        """(seconds left, how it is known: 'measured' or 'expected'), (None, '') when nothing says."""
        if self.eta is not None:
            seconds = self.eta(self, now)
            if seconds is not None:
                return max(0.0, seconds), "measured"
        if self.total and self.done > 0:
            return (now - self.start) / self.done * max(0.0, self.total - self.done), "measured"
        if self.expected is not None:
            return self.expected - (now - self.start), "expected"
        return None, ""

    def line(self, now: float) -> str:
        """The task in one line: what, how far, time spent, time left and how that is known."""
        elapsed = now - self.start
        what = self.detail or (f"{self.done:g}/{self.total} {self.unit}".rstrip() if self.total else "")
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total and not self.detail else ""
        text = f"{self.label}{': ' + what if what else ''}{share}, {duration(elapsed)}"
        left, how = self.left(now)
        if left is None:
            return text + " (no estimate yet)"
        if how == "expected":
            basis = f", {self.basis}" if self.basis else ""
            if left < 0:
                return text + f", over the ~{duration(self.expected)} expected{basis}"
            return text + f", ~{duration(left)} left (expected{basis})"
        return text + f", ~{duration(left)} left"


class PassProgress:
    """Work made of passes over the same units (calibration: passes over batches x decoder layers) whose a-priori
    costs differ (AWQ's search pass costs ~11 plain passes). The current pass's ETA comes from its own measured
    rate; later passes from that rate scaled by their relative cost; a pass not started yet from the previous
    pass's measured rate, scaled. Pass a Task's eta=this.eta."""

    def __init__(self, passes: list[tuple[str, float]], batches: int, layers: int,
                 clock: Callable[[], float] = time.monotonic):
        self.passes = list(passes) or [("pass", 1.0)]
        self.batches, self.layers, self.clock = max(1, batches), max(1, layers), clock
        self.index = -1  # current pass (0-based), -1 before the first
        self.units = 0  # layer-batches done in the current pass
        self.batch = 1  # the batch being forwarded (1-based)
        self.pass_start = clock()
        self.unit_start = self.pass_start  # when the unit in progress started
        self.seconds: list[float] = []  # measured seconds of each finished pass
        self.task: Task | None = None

    @property
    def per_pass(self) -> int:
        """Units in one pass: batches x layers."""
        return self.batches * self.layers

    @property
    def name(self) -> str:
        """The current pass's name."""
        return self.passes[max(self.index, 0)][0]

    def begin_pass(self) -> None:
        """A new pass starts (a pass beyond those expected counts as one plain pass)."""
        now = self.clock()
        self.index += 1
        if self.index >= len(self.passes):
            self.passes.append((f"pass {self.index + 1}", 1.0))
        self.pass_start, self.unit_start, self.units = now, now, 0
        self._show(0, 0)

    def end_pass(self) -> float:
        """The current pass is complete; returns its seconds (kept in self.seconds)."""
        self.units = self.per_pass
        self.seconds.append(self.clock() - self.pass_start)
        return self.seconds[-1]

    def at(self, batch: int, layer: int) -> None:
        """Batch `batch` (1-based) is entering decoder layer `layer` (0-based): the layers before it are done."""
        self.batch = batch
        units = min(self.per_pass, (batch - 1) * self.layers + layer)
        if units != self.units:
            self.units, self.unit_start = units, self.clock()
        self._show(batch, layer)

    def _show(self, batch: int, layer: int) -> None:
        if self.task is None:
            return
        where = f"batch {batch}/{self.batches}" + (f", layer {layer + 1}/{self.layers}" if self.layers > 1 else "")
        self.task.detail = (f"pass {self.index + 1}/{len(self.passes)} ({self.name}), {where}" if batch
                            else f"pass {self.index + 1}/{len(self.passes)} ({self.name})")

    def eta(self, _task: Task, now: float) -> float | None:
        """Seconds left: the rest of this pass at its measured rate, later passes scaled by their cost."""
        if self.index < 0:
            return None
        weight = self.passes[self.index][1]
        if self.units > 0:
            rate = (self.unit_start - self.pass_start) / self.units  # seconds per unit of this pass
        elif len(self.seconds) == self.index and self.seconds:  # the previous pass, scaled by the cost model
            rate = self.seconds[-1] / self.per_pass * weight / self.passes[self.index - 1][1]
        else:
            return None
        in_unit = now - self.unit_start
        rate = max(rate, in_unit)  # the unit in progress has already taken this long
        later = sum(w for _, w in self.passes[self.index + 1:]) / weight
        return rate * (self.per_pass - self.units) - in_unit + rate * self.per_pass * later


# ---------------------------------------------------------------------------------------------- console
_real_streams: list = []  # the stderr to draw on while library_output() has replaced sys.stderr


class Console:
    """Renders the innermost open task: redrawn in place on a terminal, periodic plain lines elsewhere.

    tick(now) is the whole policy (the background thread only calls it), so tests drive it with a fake clock."""

    def __init__(self, stream=None, tty: bool | None = None, clock: Callable[[], float] = time.monotonic,
                 thread: bool = True):
        self._stream, self._tty, self.clock, self.thread = stream, tty, clock, thread
        self.tasks: list[Task] = []
        self.lock = threading.RLock()
        self.last_line = 0.0  # when the last plain line was written
        self.drawn = False  # a redrawn line is on the terminal now
        self._ticker: threading.Thread | None = None
        from quantlab.config import env_progress_mode

        self.mode = env_progress_mode()

    @property
    def stream(self):
        """Where progress goes: the stderr quantlab started with (never a library's redirected one)."""
        return self._stream or (_real_streams[-1] if _real_streams else sys.stderr)

    @property
    def tty(self) -> bool:
        """Whether lines are redrawn in place (a terminal, unless QUANTLAB_PROGRESS=lines)."""
        if self._tty is not None:
            return self._tty
        try:
            return self.mode != "lines" and self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    def open(self, t: Task) -> Task:
        """Start reporting t (the innermost task from now on)."""
        with self.lock:
            self.tasks.append(t)
            self.last_line = max(self.last_line, t.start)
            if self.thread and (self._ticker is None or not self._ticker.is_alive()):
                self._ticker = threading.Thread(target=self._run, name="quantlab-progress", daemon=True)
                self._ticker.start()
        return t

    def close(self, t: Task, ok: bool = True) -> None:
        """Stop reporting t; a task that ran at least REPORT_AFTER seconds gets a closing line."""
        with self.lock:
            parent = self.tasks[self.tasks.index(t) - 1] if t in self.tasks and self.tasks.index(t) > 0 else None
            if t in self.tasks:
                self.tasks.remove(t)
            now = self.clock()
            if t.separate and parent is not None:
                parent.nested += now - t.start
            self.clear()
            if ok and now - t.start >= REPORT_AFTER and self.mode != "off":
                own = now - t.start - t.nested
                also = f" (and {duration(t.nested)} building what it needs)" if t.nested >= 1 else ""
                self._write(f"  {t.label}: done in {duration(own)}{also}\n")
            self.last_line = now

    def clear(self) -> None:
        """Erase a redrawn line (before anything else is written to the terminal)."""
        with self.lock:
            if self.drawn:
                self._write("\r\x1b[K")
                self.drawn = False

    def tick(self, now: float | None = None) -> str | None:
        """Render the innermost task if it is due; returns what was written (None: nothing)."""
        with self.lock:
            if not self.tasks or self.mode == "off":
                return None
            now = self.clock() if now is None else now
            t = self.tasks[-1]
            if now - t.start < REPORT_AFTER:
                return None
            text = "  " + t.line(now) + "".join(p.outlook(now) for p in self.tasks[:-1] if p.outlook is not None)
            if self.tty:
                width = _width(self.stream)
                self._write("\r\x1b[K" + text[: width - 1])
                self.drawn = True
                return text
            every = FIRST_MINUTE_EVERY if now - t.start < 60 else LATER_EVERY
            if now - self.last_line < every:
                return None
            self._write(text + "\n")
            self.last_line = now
            return text

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream never stops a run
            pass

    def _run(self) -> None:
        while True:
            time.sleep(REDRAW_EVERY)
            with self.lock:
                if not self.tasks:
                    self._ticker = None
                    return
            self.tick()


def _width(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return 120


_console: Console | None = None


def console() -> Console:
    """The process's console (one, so that nested tasks share it)."""
    global _console
    if _console is None:
        _console = Console()
    return _console


@contextmanager
def task(label: str, total: int | None = None, unit: str = "", expected: float | None = None, basis: str = "",
         eta: Callable[[Task, float], float | None] | None = None, separate: bool = False) -> Iterator[Task]:
    """Report a piece of work while it runs (see the module docstring); yields the Task to advance. separate: a
    step of its own, whose time an enclosing task does not count as its own."""
    c = console()
    t = c.open(Task(label, total, unit, expected, basis, c.clock, eta, separate=separate))
    ok = False
    try:
        yield t
        ok = True
    finally:
        c.close(t, ok)


def iterate(items, label: str, total: int, unit: str, per_item: int = 1):
    """items, reported as a task of `total` units (each item done counts per_item, the last one what is left): a
    loop becomes reported by wrapping its iterable, nothing else changes."""
    with task(label, total=total, unit=unit) as t:
        for item in items:
            yield item
            t.advance(min(per_item, max(0, total - t.done)))


def current() -> Task | None:
    """The innermost open task (the step being built), or None."""
    c = console()
    with c.lock:
        return c.tasks[-1] if c.tasks else None


def note(detail: str) -> None:
    """Say what the innermost open task is doing now (e.g. "importing NVIDIA ModelOpt"); nothing when none is open."""
    c = console()
    with c.lock:
        if c.tasks:
            c.tasks[-1].detail = detail


# ------------------------------------------------------------------------------------- library output
class _ToLog(io.TextIOBase):
    """A stream that sends complete lines to the log (progress bars' carriage-return redraws: the last state)."""

    def __init__(self, logger: logging.Logger, name: str):
        self.logger, self.name, self.buf = logger, name, ""

    def writable(self) -> bool:
        """Always: it is an output stream."""
        return True

    def write(self, text: str) -> int:
        """Buffer text; log every complete line."""
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self._emit(line)
        return len(text)

    def _emit(self, line: str) -> None:
        line = line.rsplit("\r", 1)[-1].strip() if "\r" in line else line.strip()
        if line:
            self.logger.info("[%s] %s", self.name, line)

    def flush(self) -> None:
        """Keep a partial line until it ends (a bar's final state is emitted at the end of the step)."""

    def close_out(self) -> None:
        """Emit what is left."""
        if self.buf.strip():
            self._emit(self.buf)
        self.buf = ""

    def isatty(self) -> bool:
        """Never: libraries then draw no animated bars into it."""
        return False


_depth = 0


@contextmanager
def library_output() -> Iterator[None]:
    """While a step runs: what libraries print (ModelOpt's 'Inserted 756 quantizers', progress bars) goes to the
    run's log, not the console. quantlab's own progress keeps drawing on the real stderr. Re-entrant."""
    global _depth
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    real_out, real_err = sys.stdout, sys.stderr
    out, err = _ToLog(LIB, "stdout"), _ToLog(LIB, "stderr")
    if _in_run:
        _route_transformers()
    _real_streams.append(real_err)
    _quiet_bars()
    _depth = 1
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = real_out, real_err
        _real_streams.pop()
        _depth = 0
        out.close_out()
        err.close_out()


def _quiet_bars() -> None:
    """Libraries' own progress bars off (quantlab reports progress itself)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass


class LibraryWarnings(logging.Handler):
    """Counts what libraries warn about during a run (Python warnings and their loggers' warnings): the run's log
    has each one, the console one line (summary())."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.counts: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        """Count a warning record that is not quantlab's own."""
        if record.name == "py.warnings":
            kind = (record.args[2] if isinstance(record.args, tuple) and len(record.args) > 2 else None)
            self.counts[getattr(kind, "__name__", None) or _warning_kind(record.getMessage())] += 1
        elif not (record.name == "quantlab" or record.name.startswith("quantlab.")) or record.name == LIB.name:
            self.counts[record.name.split(".")[0]] += 1

    def summary(self, where: Path | None) -> str | None:
        """'libraries warned 12 times (DeprecationWarning 9, transformers 3): see LOG', or None."""
        total = sum(self.counts.values())
        if not total:
            return None
        kinds = ", ".join(f"{k} {n}" for k, n in self.counts.most_common(4))
        return f"libraries warned {total} time{'s' if total != 1 else ''} ({kinds}){f': see {where}' if where else ''}"


def _warning_kind(message: str) -> str:
    head = message.split(":", 3)
    return head[2].strip().split()[-1] if len(head) > 2 and head[2].strip() else "warning"


class _Transformers:
    """transformers writes to the console through a handler of its own: while a run lasts, its records go to the
    root handlers instead (the run's log; the console filter shows none below ERROR)."""

    def __init__(self, hf_logging):
        self.hf = hf_logging
        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()

    def restore(self) -> None:
        """Give transformers its own handler back."""
        self.hf.disable_propagation()
        self.hf.enable_default_handler()


_routed: list[_Transformers] = []  # set once per run, when a step first runs with transformers imported
_in_run: list[Path] = []  # run_logging's run directories (the innermost last)


def _route_transformers() -> None:
    hf = sys.modules.get("transformers.utils.logging")
    if hf is not None and not _routed:
        _routed.append(_Transformers(hf))


class _ConsoleFilter(logging.Filter):
    """On console handlers: quantlab's own records (erasing a redrawn progress line first); other loggers' only
    from ERROR up; what libraries printed (quantlab.lib) and Python warnings never (they are in the log file)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether the console shows record."""
        own = record.name == "quantlab" or record.name.startswith("quantlab.")
        if record.name == LIB.name or record.name == "py.warnings":
            return False
        if own or record.levelno >= logging.ERROR:
            console().clear()
            return True
        return False


@dataclass
class RunLog:
    """What run_logging set up: the run's log file and the warning counter."""

    path: Path | None
    warnings: LibraryWarnings


@contextmanager
def run_logging(run_dir: Path) -> Iterator[RunLog]:
    """For one run: a log file in run_dir (Hydra's job log when Hydra made one, else run_dir/quantlab.log) that
    receives everything, the console filtered to quantlab's own lines, Python warnings captured into the log and
    counted. Everything is restored afterwards (the Python API runs many runs in one process)."""
    root = logging.getLogger()
    run_dir = Path(run_dir).resolve()
    own_file = None
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)
             and Path(h.baseFilename).resolve().parent == run_dir]
    if files:
        path = Path(files[0].baseFilename)
    else:
        path = run_dir / "quantlab.log"
        own_file = logging.FileHandler(path, encoding="utf-8")
        own_file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(own_file)
    consoles = [h for h in root.handlers if isinstance(h, logging.StreamHandler)
                and not isinstance(h, logging.FileHandler)]
    flt, counter = _ConsoleFilter(), LibraryWarnings()
    for h in consoles:
        h.addFilter(flt)
    root.addHandler(counter)
    _routed.clear()
    _in_run.append(run_dir)
    levels = {name: logging.getLogger(name).level for name in ("quantlab", "py.warnings")}
    if logging.getLogger("quantlab").getEffectiveLevel() > logging.INFO:
        logging.getLogger("quantlab").setLevel(logging.INFO)  # the log file gets quantlab's INFO lines
    logging.captureWarnings(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            yield RunLog(path, counter)
    finally:
        _in_run.pop()
        if _routed:
            _routed.pop().restore()
        logging.captureWarnings(False)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        root.removeHandler(counter)
        for h in consoles:
            h.removeFilter(flt)
        if own_file is not None:
            root.removeHandler(own_file)
            own_file.close()
