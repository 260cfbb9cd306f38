"""Rebuild a sweep summary from run directories: python -m quantlab.summary DIR [DIR ...] [--out OUT].

Exit codes follow the main CLI's: 0 written, 2 bad arguments (no run directory found, an output that cannot be
written), 3 a bug, 130 interrupted."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from quantlab.errors import QuantlabError, cli_guard
from quantlab.report.sweep import find_runs, headline, summary_rows, write_summary


def main(argv: list[str] | None = None) -> int:
    """The summary CLI."""
    parser = argparse.ArgumentParser(prog="python -m quantlab.summary", description=__doc__)
    parser.add_argument("dirs", nargs="+", type=Path, help="run directories or sweep directories holding them")
    parser.add_argument("--out", type=Path, help="where to write summary.md / summary.html (default: the first DIR)")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        raise QuantlabError(f"not a directory: {', '.join(missing)}", fix="give run directories or a sweep directory")
    runs = find_runs(args.dirs)
    if not runs:
        raise QuantlabError(f"no run directories (with run.json or status.json) under {', '.join(map(str, args.dirs))}",
                            fix="give the directories quantlab wrote (outputs/... or a sweep directory)")
    out = args.out or args.dirs[0]
    probe = out if out.exists() else out.parent
    if (out.exists() and not out.is_dir()) or not os.access(probe if probe.exists() else Path.cwd(), os.W_OK):
        raise QuantlabError(f"cannot write the summary into {out}", fix="give --out a writable directory")
    rows = summary_rows(runs)
    _md, html = write_summary(out, runs, rows)
    print(f"quantlab: summary of {len(runs)} runs: {headline(rows)} -> {html}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_guard(main))
