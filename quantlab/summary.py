"""Rebuild a sweep summary from run directories: python -m quantlab.summary DIR [DIR ...] [--out OUT]."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from quantlab.report.sweep import find_runs, write_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantlab.summary", description=__doc__)
    parser.add_argument("dirs", nargs="+", type=Path, help="run directories or sweep directories holding them")
    parser.add_argument("--out", type=Path, help="where to write summary.md / summary.html (default: the first DIR)")
    args = parser.parse_args(argv)
    runs = find_runs(args.dirs)
    if not runs:
        print(f"quantlab: error: no run directories (with run.json) under {', '.join(map(str, args.dirs))}", file=sys.stderr)
        return 2
    md, html = write_summary(args.out or args.dirs[0], runs)
    print(f"quantlab: summary of {len(runs)} runs -> {html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
