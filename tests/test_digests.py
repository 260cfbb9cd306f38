"""The store's file digests: a large file is digested as a tree of segments hashed in parallel, the digest names its
scheme, a manifest written with the other scheme still verifies, a changed byte is found under either, and a
manifest with a digest that is not a string is damage, not a crash."""
from __future__ import annotations

import hashlib
import os

from quantlab import artifacts
from quantlab.artifacts import TREE_PREFIX, TREE_SEGMENT, ArtifactStore, fingerprint_files, sha256_file


def _file(path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def test_tree_digest_is_the_sha256_of_the_segments_digests(tmp_path):
    data = _file(tmp_path / "w.safetensors", 2 * TREE_SEGMENT + 12345)  # two full segments and a short last one
    segments = [data[i:i + TREE_SEGMENT] for i in range(0, len(data), TREE_SEGMENT)]
    expected = TREE_PREFIX + hashlib.sha256(b"".join(hashlib.sha256(s).digest() for s in segments)).hexdigest()
    assert sha256_file(tmp_path / "w.safetensors", tree=True) == expected
    assert sha256_file(tmp_path / "w.safetensors", tree=False) == hashlib.sha256(data).hexdigest()
    assert sha256_file(tmp_path / "w.safetensors") == hashlib.sha256(data).hexdigest()  # under the tree size


def test_empty_file_has_a_tree_digest_too(tmp_path):
    (tmp_path / "e").write_bytes(b"")
    expected = TREE_PREFIX + hashlib.sha256(hashlib.sha256(b"").digest()).hexdigest()
    assert sha256_file(tmp_path / "e", tree=True) == expected


def test_a_manifest_of_either_scheme_verifies_and_a_changed_byte_is_found(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path / "cache")

    def build(out):
        _file(out / "big.bin", TREE_SEGMENT + 7)
        _file(out / "small.json", 100)
        return {}

    monkeypatch.setattr(artifacts, "TREE_MIN_BYTES", TREE_SEGMENT)  # "large" from one segment up
    art, built = store.get_or_build("export", "k1", build, {})
    files = art.manifest["files"]
    assert files["big.bin"].startswith(TREE_PREFIX) and not files["small.json"].startswith(TREE_PREFIX)
    assert store.load("export", "k1") is not None

    # a byte changed under a tree-digest manifest is found: the entry is discarded and built again
    _flip(art.path / "big.bin", 5)
    assert store.load("export", "k1") is None
    art, built = store.get_or_build("export", "k1", build, {})
    assert built is not None and store.load("export", "k1") is not None
    files = art.manifest["files"]

    # a manifest written before tree digests (plain sha256 of the large file) still verifies: not rebuilt
    manifest_path = art.path / artifacts.MANIFEST
    manifest = art.manifest
    manifest["files"] = {**files, "big.bin": hashlib.sha256((art.path / "big.bin").read_bytes()).hexdigest()}
    manifest_path.write_text(artifacts.canonical_json(manifest))
    assert fingerprint_files(art.path, like=manifest["files"]) == manifest["files"]
    assert store.load("export", "k1") is not None

    # one byte changed in the last segment under the plain-sha256 manifest: found too, the entry is discarded
    _flip(art.path / "big.bin", TREE_SEGMENT + 3)
    assert store.load("export", "k1") is None


def test_a_manifest_with_a_digest_of_the_wrong_type_is_damaged_not_a_crash(tmp_path):
    store = ArtifactStore(tmp_path / "cache")
    art, _ = store.get_or_build("export", "k2", lambda out: _file(out / "a.json", 10) and {}, {})
    manifest = art.manifest
    manifest["files"] = {"a.json": 5}
    (art.path / artifacts.MANIFEST).write_text(artifacts.canonical_json(manifest))
    assert store.load("export", "k2") is None  # reported damaged and moved aside, as any other damage


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
