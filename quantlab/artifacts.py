"""Content-addressed artifact store.

key = hash(stage, its config, input fingerprints, library versions, device class). An artifact is a directory
`<root>/<stage>/<key>/` whose `manifest.json` is written last; it is built in a temp directory and renamed
into place, so a reader never sees a half-written artifact. A file lock per key makes concurrent sweeps build
each artifact once. On every load the files are checked against the fingerprints in the manifest; a
mismatch is reported and the entry rebuilt, never used.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from filelock import FileLock, Timeout

from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1


def default_cache_dir() -> Path:
    """The artifact store: $QUANTLAB_CACHE, else ~/.cache/quantlab."""
    from quantlab.config import env_cache_dir

    env = env_cache_dir()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantlab"


def canonical_json(obj: Any) -> str:
    """obj as JSON with sorted keys and no spaces (the form every key is hashed in)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def hash_obj(obj: Any) -> str:
    """sha256 hex digest of canonical_json(obj)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


TREE_MIN_BYTES = 1 << 30  # files at least this large are digested as a tree of segments, the segments in parallel
TREE_SEGMENT = 1 << 26  # 64 MiB
TREE_PREFIX = "tree64m:"  # digest = TREE_PREFIX + sha256(the segments' sha256 digests, in order)
_READ = 1 << 23  # 8 MiB a read: memory stays at workers x 8 MiB


def _sha256_range(path: Path, start: int, length: int) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = length
        while left > 0:
            block = f.read(min(_READ, left))
            if not block:
                break
            h.update(block)  # hashlib releases the GIL on large buffers: segments hash in parallel
            left -= len(block)
    return h.digest()


def hash_workers() -> int:
    """Threads that digest a large file's segments: the CPUs this process may use, at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


def sha256_file(path: Path, chunk: int = 1 << 24, tree: bool | None = None) -> str:
    """The digest of a file: its sha256 hex digest, or for a file of TREE_MIN_BYTES or more (tree=None) a tree
    digest, TREE_PREFIX + sha256 of its 64 MiB segments' sha256 digests, the segments hashed by hash_workers()
    threads (one sha256 of a 16 GB checkpoint is ~10-20 s on one core; a digest of either kind names its scheme, so
    a manifest written with the other one still verifies: tree=True / False forces it)."""
    path = Path(path)
    size = path.stat().st_size
    if tree is None:
        tree = size >= TREE_MIN_BYTES
    if not tree:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
        return h.hexdigest()
    from concurrent.futures import ThreadPoolExecutor

    starts = range(0, max(size, 1), TREE_SEGMENT)
    with ThreadPoolExecutor(max_workers=hash_workers()) as pool:
        digests = list(pool.map(lambda s: _sha256_range(path, s, min(TREE_SEGMENT, size - s)), starts))
    return TREE_PREFIX + hashlib.sha256(b"".join(digests)).hexdigest()


def fingerprint_files(root: Path, files: Iterable[Path] | None = None,
                      like: dict[str, str] | None = None) -> dict[str, str]:
    """The digest (sha256_file) of every regular file under root (relative posix path -> digest), manifest
    excluded. like: earlier digests by name; a file named there is digested with the scheme its earlier digest
    used (a manifest written before tree digests, or with another size limit, verifies the same files)."""
    files = sorted(files) if files is not None else sorted(p for p in root.rglob("*") if p.is_file())
    out = {}
    for p in files:
        if p.name == MANIFEST:
            continue
        name = p.relative_to(root).as_posix()
        earlier = like.get(name) if isinstance(like, dict) else None
        out[name] = sha256_file(p, tree=earlier.startswith(TREE_PREFIX) if isinstance(earlier, str) else None)
    return out


def fingerprint_of(files: dict[str, str]) -> str:
    """The 16-hex-digit fingerprint of a set of files (name -> sha256)."""
    return hash_obj(files)[:16]


def write_text_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a half-written one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write obj as indented JSON through a temporary file renamed into place (a reader never sees half a file)."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


@dataclass
class Built:
    """What a build function may return instead of a bare info dict: the info recorded in the manifest, and the
    value it made in memory (e.g. the calibrated model), handed to the caller instead of being reloaded."""

    info: dict
    value: Any = None


@dataclass
class Artifact:
    """A built entry of the store: its stage, key, directory and manifest (fingerprint, info, file hashes)."""
    stage: str
    key: str
    path: Path
    manifest: dict

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the artifact's files (from its manifest)."""
        return self.manifest["fingerprint"]

    @property
    def info(self) -> dict:
        """What the build recorded about itself (manifest "info")."""
        return self.manifest.get("info", {})


def _no_room(exc: OSError, where: Path, written: int = 0) -> QuantlabError | None:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            free = 0
        need = (f": the build had written {_mib(written)} when the disk filled, so it needs more than "
                f"{_mib(written + free)} free ({_mib(free)} free now; nothing of the unfinished build is kept)"
                if written else "")
        return QuantlabError(f"no space left on the device of the cache {where}{need}",
                             fix="free space (python -m quantlab.cache prune --older-than DAYS) or set cache_dir / "
                                 "$QUANTLAB_CACHE to a disk with room, then rerun: finished artifacts are reused")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return QuantlabError(f"the cache {where} is not writable ({exc.strerror})",
                             fix="set cache_dir (or $QUANTLAB_CACHE) to a writable directory")
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under path (0 when it is gone)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _says_no_space(exc: BaseException) -> bool:
    """A library's own error for a full disk (safetensors' SafetensorError carries the OS message, not an errno)."""
    text = str(exc)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


def _disk_full(root: Path, margin: int = 1 << 20) -> bool:
    """True when the cache's device has less than `margin` bytes free (writers other than Python's own, such as
    safetensors' Rust code, report a full disk in their own words)."""
    try:
        return shutil.disk_usage(root).free < margin
    except OSError:
        return False


class ArtifactStore:
    """The content-addressed store (see the module docstring); `events` records what this process built or reused."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root).expanduser() if root else default_cache_dir()
        if self.root.exists() and not self.root.is_dir():
            raise QuantlabError(f"the cache {self.root} is a file, not a directory",
                                fix="set cache_dir (or $QUANTLAB_CACHE) to a directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise (_no_room(exc, self.root)
                   or QuantlabError(f"the cache {self.root} cannot be created ({exc.strerror})",
                                    fix="set cache_dir to a writable directory")) from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise QuantlabError(f"the cache {self.root} is not writable",
                                fix="set cache_dir (or $QUANTLAB_CACHE) to a writable directory")
        self.events: list[tuple[str, str, str]] = []  # (stage, key, "built" | "reused"), for the run log

    def key(self, stage: str, **parts: Any) -> str:
        """The store key of a stage's artifact: a hash of the stage and every part that identifies it."""
        return hash_obj({"stage": stage, **parts})[:20]

    def path(self, stage: str, key: str) -> Path:
        """The directory of an artifact."""
        return self.root / stage / key

    def lock(self, stage: str, key: str) -> FileLock:
        """The per-key lock builds hold (and cache prune takes before removing an entry)."""
        lock_dir = self.root / ".locks"
        lock_dir.mkdir(exist_ok=True)
        return FileLock(str(lock_dir / f"{stage}-{key}.lock"))

    def load(self, stage: str, key: str, verify: bool = True) -> Artifact | None:
        """The finished artifact, or None. A damaged entry is reported and moved aside."""
        path = self.path(stage, key)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
            if verify:
                expected = manifest["files"]
                actual = fingerprint_files(path, like=expected)
                if actual != expected:
                    changed = sorted(set(expected) ^ set(actual)
                                     | {k for k in expected if actual.get(k) != expected[k]})
                    raise ValueError(f"files changed since they were written: {', '.join(changed[:5])}")
        except (ValueError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            log.warning("cache entry %s/%s is damaged (%s); rebuilding it", stage, key, exc)
            self._discard(path)
            return None
        return Artifact(stage, key, path, manifest)

    def _discard(self, path: Path) -> None:
        trash = self.root / ".trash" / f"{path.parent.name}-{path.name}-{uuid.uuid4().hex[:8]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def get_or_build(
        self,
        stage: str,
        key: str,
        build: Callable[[Path], dict | Built],
        manifest_extra: dict,
        describe: str = "",
        cost: dict | None = None,
    ) -> tuple[Artifact, Built | None]:
        """(artifact, what this call built or None): the artifact for key, built with build(tmp_dir) -> info (or
        Built(info, value)) once across processes; a process that finds it built by another gets None.

        cost: what the build's time depends on (device, variant, params, size); recorded with the wall time
        (less info["upstream_seconds"], time the build spent making its inputs) and the machine, so that
        quantlab.plan can predict later builds (see quantlab/costs.py)."""
        found = self.load(stage, key)
        if found is not None:
            if (stage, key, "reused") not in self.events and (stage, key, "built") not in self.events:
                log.info("%s: reusing %s", stage, found.path)  # once: a sequential gate reads its blocks at every look
            self.events.append((stage, key, "reused"))
            return found, None
        lock = self.lock(stage, key)
        try:
            lock.acquire(timeout=1)
        except Timeout:
            log.info("%s: another process is building %s (%s); waiting for it", stage, key, describe or stage)
            lock.acquire()
        try:
            found = self.load(stage, key)
            if found is not None:
                self.events.append((stage, key, "reused"))
                return found, None
            for stale in (self.root / ".tmp").glob(f"{stage}-{key}-*"):  # an interrupted build of this key
                log.info("%s: removing the unfinished build %s left by an interrupted run", stage, stale.name)
                shutil.rmtree(stale, ignore_errors=True)
            tmp = self.root / ".tmp" / f"{stage}-{key}-{uuid.uuid4().hex[:8]}"
            try:
                tmp.mkdir(parents=True)
                start = time.time()
                if cost is not None:
                    from quantlab.costs import cpu_sample

                    cpu_before = cpu_sample()
                result = build(tmp)
                built = result if isinstance(result, Built) else Built(result or {})
                info = built.info
                files = fingerprint_files(tmp)
                manifest = {
                    "schema_version": SCHEMA_VERSION,
                    "stage": stage,
                    "key": key,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "wall_time_s": round(time.time() - start, 3),
                    "fingerprint": fingerprint_of(files),
                    "files": files,
                    "info": info,
                    **manifest_extra,
                }
                if cost is not None:
                    from quantlab.costs import busy_share, record

                    # time spent inside build() obtaining an input (e.g. calibrating the model an export
                    # writes) belongs to the stage that made the input
                    own = manifest["wall_time_s"] - float(info.get("upstream_seconds", 0.0))
                    manifest["cost"] = record(stage, round(max(own, 0.0), 3), cost,
                                              busy_share(cpu_before, manifest["wall_time_s"]))
                write_json_atomic(tmp / MANIFEST, manifest)
                final = self.path(stage, key)
                final.parent.mkdir(parents=True, exist_ok=True)
                if final.exists():  # a damaged leftover without a manifest
                    self._discard(final)
                os.replace(tmp, final)
            except Exception as exc:
                # measured before the partial build is removed (removing it frees the space that ran out)
                full = not isinstance(exc, QuantlabError) and (_disk_full(self.root) or _says_no_space(exc))
                written = _tree_bytes(tmp)
                shutil.rmtree(tmp, ignore_errors=True)
                mapped = _no_room(exc, self.root, written) if isinstance(exc, OSError) else None
                if mapped is None and full:  # raised by a library in its own words (safetensors' Rust writer)
                    mapped = _no_room(OSError(errno.ENOSPC, "no space"), self.root, written)
                if mapped is not None:
                    raise mapped from None
                raise
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self.events.append((stage, key, "built"))
            return Artifact(stage, key, final, manifest), built
        finally:
            lock.release()

    def entries(self) -> list[Artifact]:
        """Every complete artifact in the store (manifest readable), sorted by path."""
        out = []
        for manifest_path in sorted(self.root.glob(f"*/*/{MANIFEST}")):
            try:
                manifest = json.loads(manifest_path.read_text())
            except json.JSONDecodeError:
                continue
            out.append(Artifact(manifest_path.parent.parent.name, manifest_path.parent.name, manifest_path.parent,
                                manifest))
        return out
