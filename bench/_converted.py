"""Shared setup of the benches that time work on a fresh artifact cache: the one-time GGUF conversion of the default
model is nobody's cost (every bench keeps it out of its timings), so a fresh cache is seeded with the converted model
from the user's cache (quantlab.artifacts.default_cache_dir(): $QUANTLAB_CACHE or ~/.cache/quantlab) when it is
there; the store verifies the copied files against their manifest on load. Nothing else is copied."""
from __future__ import annotations

import shutil
from pathlib import Path


def seed_converted_model(cache: str | Path, source: str | Path | None = None) -> int:
    """Copy the converted models (prepare artifacts) of `source` into the fresh cache; returns how many."""
    from quantlab.artifacts import default_cache_dir

    src = Path(source) if source else default_cache_dir()
    copied = 0
    for entry in sorted((src / "prepare").glob("*/manifest.json")):
        dest = Path(cache) / "prepare" / entry.parent.name
        if not dest.exists():
            shutil.copytree(entry.parent, dest)
            copied += 1
    return copied
