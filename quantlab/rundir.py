"""The run directory: what a run leaves (RunResult), and the three things every writer of one does: set the reports
of an earlier run aside, link what it made, and write run.json with the final line last.

Both writers use it: a configuration run (quantlab.pipeline) and a search (quantlab.search.driver).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from quantlab.artifacts import write_json_atomic

log = logging.getLogger("quantlab")
# what a run writes into its directory: a rerun into the same directory moves an earlier run's copies aside
REPORT_FILES = ("metrics.json", "report.md", "report.html", "junit.xml", "run.json", "checkpoint", "traceback.txt",
                "audit.json")
SEARCH_FILES = ("search.json", "frontier.png", "winner", "evals")


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


def finish(run_dir: Path, record: dict, start: float, code: int, what: str, doc: dict | None = None,
           where: str | None = None) -> RunResult:
    """Write run.json (exit code and wall time added to record) and print the run's final line."""
    record["wall_time_s"] = round(time.time() - start, 2)
    record["exit_code"] = code
    write_json_atomic(run_dir / "run.json", record)
    print(f"quantlab: {what} in {record['wall_time_s']:.1f} s -> {where or run_dir}")
    return RunResult(code, run_dir, doc, record)
