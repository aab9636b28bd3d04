"""Content identity of checkpoints (memcache_core.checkpoint): what a weight swap at one path
changes, and what a faithful copy keeps."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from memcache_core.checkpoint import manifest_digest


def write_safetensors(path: Path, payload: bytes, shape: tuple[int, ...] = (4,)) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": list(shape), "data_offsets": [0, len(payload)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text('{"hidden_size": 4}')
    write_safetensors(root / "model.safetensors", b"\1\2\3\4")
    (root / "README.md").write_text("not identity")
    return root


def test_other_weights_swapped_in_at_the_same_path_are_another_checkpoint(checkpoint: Path,
                                                                         tmp_path: Path) -> None:
    """Scenario (issue 21, item 3): another checkpoint of the same shape (same config, same
    safetensors header, same size) replaces the files at one path. Its files are newer: another
    digest. With ``full`` the bytes decide, whatever the times."""
    before, before_full = manifest_digest(checkpoint), manifest_digest(checkpoint, full=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"hidden_size": 4}')
    write_safetensors(other / "model.safetensors", b"\4\3\2\1")
    st = (checkpoint / "model.safetensors").stat()
    os.utime(other / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    shutil.copy2(other / "model.safetensors", checkpoint / "model.safetensors")
    assert manifest_digest(checkpoint) != before
    assert manifest_digest(checkpoint, full=True) != before_full
    # Same bytes with the old time put back: only the full hash sees it.
    os.utime(checkpoint / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert manifest_digest(checkpoint) == before
    assert manifest_digest(checkpoint, full=True) != before_full


def test_a_copy_that_keeps_times_is_the_same_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    """Scenario: ``cp -p`` / ``rsync -t`` copies share; a copy with new times shares only with
    ``full``; a non-weight file never matters; a changed config or header always does."""
    kept = tmp_path / "kept"
    shutil.copytree(checkpoint, kept)
    assert manifest_digest(kept) == manifest_digest(checkpoint)
    fresh = tmp_path / "fresh"
    shutil.copytree(checkpoint, fresh, copy_function=shutil.copyfile)
    os.utime(fresh / "model.safetensors", ns=(1, 1))
    assert manifest_digest(fresh) != manifest_digest(checkpoint)
    assert manifest_digest(fresh, full=True) == manifest_digest(checkpoint, full=True)
    (kept / "README.md").write_text("changed")
    assert manifest_digest(kept) == manifest_digest(checkpoint)
    (kept / "config.json").write_text('{"hidden_size": 8}')
    assert manifest_digest(kept) != manifest_digest(checkpoint)


def test_hub_cache_files_are_named_by_their_blob(tmp_path: Path) -> None:
    """Scenario: a hub snapshot's weight file is a link to ``blobs/<hash>``: the blob name is its
    identity, the same on every host (no read, no time)."""
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    write_safetensors(blobs / "aaaa", b"\1\2\3\4")
    write_safetensors(blobs / "bbbb", b"\1\2\3\4")
    snap = tmp_path / "hub" / "snapshots" / "c1"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(blobs / "aaaa")
    first = manifest_digest(snap)
    os.utime(blobs / "aaaa", ns=(1, 1))
    assert manifest_digest(snap) == first
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(blobs / "bbbb")
    assert manifest_digest(snap) != first


def test_nothing_to_identify_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no weight or config file"):
        manifest_digest(tmp_path)
