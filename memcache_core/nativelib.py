"""Finding the optional native libraries (setup.py builds them where a C compiler is found).

The copy loop and the data server's loop are plain C loaded with ctypes, whose foreign calls
release the GIL, found here; the MetaService's frame loop is a CPython extension (its calls are
per wake-up, where ctypes' cost would show: docs/design.md), imported by name (``rpc/pump.py``).
Each has a Python implementation that is the reference and the fallback (``transfer/native.py``
for the copy loop). The C sources that share code include headers from ``memcache_core/native/``
(the keyed BLAKE2b of the frame MACs).
"""

from __future__ import annotations

import glob
import importlib.machinery
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def find(directory: str, stem: str) -> str | None:
    """The path of the library ``stem`` (e.g. ``_copyloop``) built into ``directory``: the one of this
    interpreter's extension suffix, else any ``stem*.so`` there (a build of another minor version of
    the same ABI); None where it was not built."""
    own = [os.path.join(directory, stem + s) for s in importlib.machinery.EXTENSION_SUFFIXES]
    found = [p for p in own if os.path.exists(p)] or sorted(glob.glob(os.path.join(directory, stem + "*.so")))
    return found[0] if found else None


def once(load: Callable[[], T]) -> Callable[[], T]:
    """``load`` run at the first call only (under a lock: two threads asking at once load once); every
    call returns what it returned (a loaded library, or None where it is not to be had)."""
    lock = threading.Lock()
    loaded: list[T] = []

    def get() -> T:
        with lock:
            if not loaded:
                loaded.append(load())
            return loaded[0]
    return get
