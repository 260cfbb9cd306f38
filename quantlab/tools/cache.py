"""List and prune the artifact cache: python -m quantlab.cache list | prune [--stage S] [--older-than DAYS] [--all].

Prune takes each entry's build lock without waiting and skips an entry (or an unfinished build) that a running
process holds, so pruning next to a running sweep never removes what it is building. Exit codes follow the main
CLI's: 0 done, 2 bad arguments, 3 a bug, 130 interrupted.
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

from filelock import Timeout

from quantlab.artifacts import ArtifactStore
from quantlab.errors import QuantlabError, cli_guard

STAGES = ("prepare", "data", "quantize", "export", "audit", "reference", "evaluate", "engine")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _store(cache_dir: str | None) -> ArtifactStore:
    if cache_dir is not None:
        root = Path(cache_dir).expanduser()
        if not cache_dir.strip() or not root.is_dir():
            raise QuantlabError(f"--cache-dir {cache_dir!r} is not an existing cache directory",
                                fix="point --cache-dir at a quantlab cache "
                                    "(default: $QUANTLAB_CACHE or ~/.cache/quantlab)")
    return ArtifactStore(cache_dir)


def prune(store: ArtifactStore, entries, older_than: float | None) -> tuple[int, int]:
    """(removed, skipped because a build holds them): entries older than `older_than` days (all when None), and
    unfinished builds nobody holds."""
    cutoff = time.time() - (older_than or 0) * 86400
    removed = skipped = 0
    for e in entries:
        if older_than is not None and (e.path / "manifest.json").stat().st_mtime >= cutoff:
            continue
        lock = store.lock(e.stage, e.key)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            skipped += 1
            continue
        try:
            store._discard(e.path)
            removed += 1
        finally:
            lock.release()
    for tmp in sorted((store.root / ".tmp").glob("*")) if (store.root / ".tmp").is_dir() else []:
        stage, _, rest = tmp.name.partition("-")
        key = rest.rpartition("-")[0]
        lock = store.lock(stage, key)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue  # being built right now
        try:
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            lock.release()
    return removed, skipped


def main(argv: list[str] | None = None) -> int:
    """The cache CLI."""
    ap = argparse.ArgumentParser(prog="python -m quantlab.cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("list", "prune"))
    ap.add_argument("--cache-dir", help="default: $QUANTLAB_CACHE or ~/.cache/quantlab")
    ap.add_argument("--stage", choices=STAGES, help="only entries of this stage")
    ap.add_argument("--older-than", type=float, metavar="DAYS", help="prune: only entries not modified for DAYS (>= 0)")
    ap.add_argument("--all", action="store_true", help="prune: every matching entry (required without --older-than)")
    args = ap.parse_args(argv)
    store = _store(args.cache_dir)
    entries = [e for e in store.entries() if not args.stage or e.stage == args.stage]
    if args.action == "list":
        total = 0
        for e in entries:
            size = _size(e.path)
            total += size
            what = e.info.get("quant_algo") or e.manifest.get("role") or e.manifest.get("model", "")
            print(f"{e.stage:10s} {e.key}  {size / 2**20:9.1f} MiB  {e.manifest.get('created', '?')}  {what}")
        print(f"{len(entries)} entries, {total / 2**20:.1f} MiB in {store.root}")
        return 0
    if args.older_than is None and not args.all:
        raise QuantlabError("prune needs --older-than DAYS or --all", fix="e.g. prune --older-than 30")
    if args.older_than is not None and (not math.isfinite(args.older_than) or args.older_than < 0):
        raise QuantlabError(f"--older-than {args.older_than} is not a number of days >= 0",
                            fix="e.g. --older-than 30 (entries unused for 30 days)")
    if args.older_than is not None and args.all:
        raise QuantlabError("--all and --older-than contradict each other", fix="give one of them")
    removed, skipped = prune(store, entries, args.older_than)
    note = f" ({skipped} skipped: a running build holds them)" if skipped else ""
    print(f"removed {removed} entries from {store.root}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_guard(main))
