"""List and prune the artifact cache: python -m quantlab.cache list | prune [--stage S] [--older-than DAYS] [--all]."""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from quantlab.artifacts import ArtifactStore


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quantlab.cache", description=__doc__)
    ap.add_argument("action", choices=("list", "prune"))
    ap.add_argument("--cache-dir", help="default: $QUANTLAB_CACHE or ~/.cache/quantlab")
    ap.add_argument("--stage", help="only entries of this stage (prepare, data, quantize, export, reference, engine)")
    ap.add_argument("--older-than", type=float, metavar="DAYS", help="prune: only entries not modified for DAYS")
    ap.add_argument("--all", action="store_true", help="prune: every matching entry (required without --older-than)")
    args = ap.parse_args(argv)
    store = ArtifactStore(args.cache_dir)
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
        print("quantlab: error: prune needs --older-than DAYS or --all", file=sys.stderr)
        return 2
    cutoff = time.time() - (args.older_than or 0) * 86400
    removed = 0
    for e in entries:
        if args.older_than is None or (e.path / "manifest.json").stat().st_mtime < cutoff:
            shutil.rmtree(e.path, ignore_errors=True)
            removed += 1
    shutil.rmtree(store.root / ".tmp", ignore_errors=True)  # leftovers of interrupted builds
    print(f"removed {removed} entries from {store.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
