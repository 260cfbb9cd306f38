"""Loading a bench script's logic into a test: the script imported as a module under a private name, the sys.path
entries it adds on import taken back, the module dropped again after the test module."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent


def bench_module(script: str, name: str) -> Iterator:
    """Yields bench/<script> imported as module `name` (for a module-scoped fixture); removed afterwards."""
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    yield module
    sys.modules.pop(spec.name, None)
