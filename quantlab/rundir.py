"""The run directory: what a run leaves (RunResult), and what every writer of one does: set the reports of an earlier
run aside, say what runs in run.json from the start (`start`), link what it made, and write run.json with the final
line last (`finish`), or the reason it stopped (`stopped`). `read_record` is how quantlab reads its own records back:
a missing or damaged file is named, never a traceback.

Both writers use it: a configuration run (quantlab.pipeline) and a search (quantlab.search.driver).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from quantlab.artifacts import write_json_atomic
from quantlab.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, QuantlabError

log = logging.getLogger("quantlab")
# what a run writes into its directory: a rerun into the same directory moves an earlier run's copies aside
REPORT_FILES = ("metrics.json", "report.md", "report.html", "junit.xml", "run.json", "checkpoint", "traceback.txt",
                "audit.json", "status.json")
SEARCH_FILES = ("search.json", "frontier.png", "winner", "evals")
RUN_JSON = "run.json"
STATUS = "status.json"  # a CLI job's exit code and error, written by quantlab.cli into its run directory
LOCK = ".quantlab.lock"  # held while a run writes its directory (quantlab.rundir.claim)
HOLDER = ".quantlab.holder.json"  # who holds it: pid, host, command, start time


class RunDirBusy(QuantlabError):
    """Another run is writing this run directory: this run is refused before it writes anything there."""


@contextlib.contextmanager
def claim(run_dir: Path, argv: list[str] | None = None):
    """Hold run_dir for one run: an OS file lock (released when the process ends, however it ends) and a note of the
    holder. A second run into a held directory raises RunDirBusy (exit 2) naming the holder, before it writes
    anything: two runs 1 s apart into one hydra.run.dir used to both exit 0, the first one's final line pointing at
    the second one's reports."""
    import socket

    from filelock import FileLock, Timeout

    run_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(run_dir / LOCK))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        holder, _ = read_record(run_dir / HOLDER, warn=False)
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, started "
               f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started_at') or 0))}: "
               f"python -m quantlab {' '.join(holder.get('argv') or [])}") if holder else "another process"
        raise RunDirBusy(f"the run directory {run_dir} is being written by another quantlab run ({who})",
                         fix="give this run a directory of its own (hydra.run.dir=..., or leave it out for a new "
                             "time-stamped one), or wait until that run ends") from None
    try:
        write_json_atomic(run_dir / HOLDER, {"pid": os.getpid(), "host": socket.gethostname(),
                                             "argv": list(argv or []), "started_at": round(time.time(), 3)})
        yield run_dir
    finally:
        (run_dir / HOLDER).unlink(missing_ok=True)
        lock.release()


@dataclass
class RunResult:
    """What a run left: its exit code (0 may ship, 1 a gate failed), directory and documents."""

    exit_code: int
    run_dir: Path
    doc: dict | None = field(default=None, repr=False)  # metrics.json, or search.json (None when the run stopped early)
    record: dict | None = field(default=None, repr=False)  # run.json

    @property
    def passed(self) -> bool:
        """True when the run exited 0 (may ship); False when a gate or the checkpoint audit failed (exit 1)."""
        return self.exit_code == 0

    @property
    def metrics(self) -> dict:
        """metrics.json's "metrics" section (metric name -> its value record); {} when the run stopped early."""
        return (self.doc or {}).get("metrics", {})

    @property
    def gate(self) -> dict:
        """metrics.json's "gate" section (passed, checks); {} when the run stopped early."""
        return (self.doc or {}).get("gate", {})


def set_aside_previous(run_dir: Path, names: tuple[str, ...] = REPORT_FILES) -> None:
    """A rerun into the directory of an earlier run (a fixed hydra.run.dir in CI) must not leave that run's
    verdict beside its own: earlier reports move to previous/<time>/, nothing is deleted."""
    old = [run_dir / n for n in names if (run_dir / n).exists() or (run_dir / n).is_symlink()]
    if not old:
        return
    dest = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    dest.mkdir(parents=True)
    for path in old:
        shutil.move(str(path), str(dest / path.name))
    log.info("moved the reports of an earlier run in %s to %s", run_dir, dest)


def link(path: Path, target: Path) -> None:
    """path -> target as a symbolic link, replaced atomically (a reader never sees it missing)."""
    tmp = path.with_name(f".{path.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, path)


CHECKPOINT_MODES = ("hardlink", "copy", "symlink")


def place_checkpoint(path: Path, source: Path, mode: str = "hardlink") -> str:
    """The checkpoint a run judged, placed in its run directory as path: "hardlink" (every file hard-linked to the
    cache's copy where both are on one filesystem, copied where not: no extra disk in the usual case), "copy", or
    "symlink" (one link into the cache: a copied or uploaded run directory, or a pruned cache, leaves it dangling).
    A single file (engine.checkpoint=FILE.gguf) is placed as a directory holding it. Built beside path and renamed
    into place; what it did ("hardlink", "copy" or "symlink")."""
    if mode not in CHECKPOINT_MODES:
        raise QuantlabError(f"run_checkpoint={mode} is not one of {', '.join(CHECKPOINT_MODES)}",
                            fix="set run_checkpoint=hardlink (the default), copy or symlink")
    source = Path(source).resolve()
    if mode == "symlink":
        link(path, source)
        return mode
    tmp = path.with_name(f".{path.name}.tmp")
    _remove(tmp)
    did = "hardlink" if mode == "hardlink" else "copy"

    def place(src: str, dst: str) -> None:
        nonlocal did
        if mode == "hardlink":
            try:
                os.link(src, dst)
                return
            except OSError:  # another filesystem, or links not allowed: copy
                did = "copy"
        shutil.copy2(src, dst)

    if source.is_file():  # a single-file checkpoint (a GGUF): a directory holding it, as quantlab reads one
        tmp.mkdir(parents=True)
        place(str(source), str(tmp / source.name))
    else:
        shutil.copytree(source, tmp, copy_function=place, symlinks=False)
    _remove(path)
    os.replace(tmp, path)
    return did


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def read_record(path: Path, warn: bool = True) -> tuple[dict | None, str | None]:
    """(the JSON object in one of quantlab's own records, None) or (None, what is wrong with it): missing, not
    readable, cut short or hand-edited into something that is not a JSON object. A damaged file is logged by name
    (warn); the caller carries on with what it can read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, "missing"
    except (OSError, UnicodeDecodeError) as exc:
        problem = f"unreadable ({type(exc).__name__}: {exc})"
    else:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as exc:
            problem = f"damaged: not complete JSON ({type(exc).__name__}: {str(exc)[:120]})"
        else:
            if isinstance(obj, dict):
                return obj, None
            problem = f"damaged: a JSON {type(obj).__name__}, not an object"
    if warn:
        log.warning("%s is %s; reading the rest of the run directory without it", path, problem)
    return None, problem


def what_ran(precision: str, kv_cache: str, engine: str, model: str | None) -> dict:
    """run.json's "run" section, written before anything is computed: what the run is, so that every reader (the
    sweep summary above all) names precision, KV cache, engine and model without parsing the config snapshot."""
    return {"precision": precision, "kv_cache": kv_cache, "engine": engine, "model": model}


def start(run_dir: Path, record: dict) -> None:
    """Write run.json as the run starts (exit_code null until it ends): a run stopped by bad input, a crash or
    Ctrl-C still says what it was."""
    record.setdefault("exit_code", None)
    record["started_at"] = round(time.time(), 3)
    write_json_atomic(run_dir / RUN_JSON, record)


def exit_code_of(exc: BaseException) -> int:
    """The exit code a run that raised exc ends with: 2 bad input, 130 interrupted, 3 a bug."""
    if isinstance(exc, QuantlabError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_BAD_INPUT if isinstance(exc, SystemExit) and exc.code == EXIT_BAD_INPUT else EXIT_INTERNAL


def stopped(run_dir: Path, exc: BaseException) -> None:
    """Record in run.json why a started run ended without finishing (bad input, a crash, Ctrl-C). A run.json that
    finish() wrote, or none at all, is left alone."""
    path = run_dir / RUN_JSON
    record, _ = read_record(path, warn=False)
    if record is None or record.get("exit_code") is not None:
        return
    record["exit_code"] = exit_code_of(exc)
    record["error"] = "interrupted" if isinstance(exc, KeyboardInterrupt) else (
        str(exc) if isinstance(exc, QuantlabError) else f"{type(exc).__name__}: {exc}")
    if isinstance(record.get("started_at"), (int, float)):
        record["wall_time_s"] = round(time.time() - record["started_at"], 2)
    write_json_atomic(path, record)


def finish(run_dir: Path, record: dict, start: float, code: int, what: str, doc: dict | None = None,
           where: str | None = None) -> RunResult:
    """Write run.json (exit code and wall time added to record) and print the run's final line."""
    record["wall_time_s"] = round(time.time() - start, 2)
    record["exit_code"] = code
    write_json_atomic(run_dir / RUN_JSON, record)
    print(f"quantlab: {what} in {record['wall_time_s']:.1f} s -> {where or run_dir}")
    return RunResult(code, run_dir, doc, record)
