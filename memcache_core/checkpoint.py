"""What model weights and adapters are, for the key namespaces of the engine integrations.

A KV block must be named by what computed it. A path says where weights were, not what they are:
a checkpoint replaced in place, or another checkpoint mounted at the same path on another host,
keeps the path. ``manifest_digest`` names a checkpoint (or adapter) directory by its files; the
engines compute it once, when they load the weights, and keep it for the life of the instance.

Each file enters by name and:

* config and index files (``*.json``, small): their bytes;
* a weight file that is a link into the Hugging Face hub cache (``.../blobs/<hash>``): the blob's
  name, the hash of its content the hub gave it (free, and the same on every host);
* any other weight file: its size, its modification time and, for ``.safetensors``, a hash of its
  header (tensor names, dtypes, shapes, offsets; a few KB read). With ``full=True`` instead the
  SHA-256 of all its bytes (reads the checkpoint once; the same on every host).

What it does not see: a weight file rewritten with the same size, the same safetensors header and
its old modification time put back. And by default, a copy of the same checkpoint on another host
is another checkpoint unless the copy kept the modification times (``rsync -t``, ``cp -p``), the
files come from the hub cache, or ``full`` is on. An operator who changes weights in place under a
running engine resets the engine's cache (or starts it again): the digest is taken at load.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
CHUNK = 1 << 20
# A safetensors header is a little-endian u64 length, then that much JSON.
MAX_SAFETENSORS_HEADER = 100 << 20


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _safetensors_header(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            return "short"
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER:
            return f"bad-length:{n}"
        return hashlib.sha256(f.read(n)).hexdigest()


def _hub_blob(path: Path) -> str | None:
    """The blob name when ``path`` is a link into a hub cache's ``blobs`` directory."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    return target.name if target.parent.name == "blobs" else None


def file_identity(path: Path, full: bool = False) -> Any:
    """The content identity of one weight file (see the module docstring)."""
    blob = _hub_blob(path)
    if blob is not None:
        return ["blob", blob]
    if full:
        return ["sha256", _sha256_file(path)]
    st = path.stat()
    out: list[Any] = ["stat", st.st_size, st.st_mtime_ns]
    if path.suffix == ".safetensors":
        out.append(_safetensors_header(path))
    return out


def manifest(root: str | os.PathLike[str], full: bool = False) -> list[list[Any]]:
    """Every config/index and weight file under ``root`` (or ``root`` itself, a file), by name."""
    base = Path(root)
    files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
    entries: list[list[Any]] = []
    for path in files:
        rel = path.name if path == base else str(path.relative_to(base))
        if path.suffix == ".json":
            entries.append([rel, hashlib.sha256(path.read_bytes()).hexdigest()])
        elif path.suffix in WEIGHT_SUFFIXES:
            entries.append([rel, file_identity(path, full)])
    return entries


def manifest_digest(root: str | os.PathLike[str], full: bool = False) -> str:
    """A digest of ``manifest(root, full)``; raises FileNotFoundError when it names no file."""
    entries = manifest(root, full)
    if not entries:
        raise FileNotFoundError(f"{root}: no weight or config file to identify it by")
    blob = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]
