"""Fault a fresh segment's pages in, in the background, and ask for huge pages where the host has them.

The first write into each 4 KiB page of a fresh shared-memory segment costs a page fault and a page
clear: puts into a never-touched segment run at ~0.1x memcpy. ``segment_prefault`` moves that work to a
background thread at start: ``MADV_POPULATE_WRITE`` (Linux 5.14+) over 64 MiB slices, each call
releasing the GIL; older kernels read one byte per page instead (a read fault of a shared tmpfs page
allocates it and maps it writable). Neither changes a byte, so puts that land meanwhile are never
disturbed, and start never waits for it. ``close`` stops it before the segment is unmapped.

Huge pages: transparent huge pages for shared memory are a host setting
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled``); under ``advise`` the segment asks for them
with ``MADV_HUGEPAGE`` before any page is faulted; under ``never`` (or ``deny``) one log line says so.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

from ..config import LocalConfig
from ..memory import Mapping, array_at

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
SLICE = 64 << 20
PAGE = 4096
THP_SHMEM = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def madvise(addr: int, length: int, advice: int) -> int:
    """0, or the errno of a failed ``madvise`` (a ctypes call: the GIL is released meanwhile)."""
    if _libc.madvise(addr, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def thp_shmem_mode(path: str = THP_SHMEM) -> str:
    """The host's transparent-huge-page mode for shared memory (the bracketed word), or "" if unknown."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def ask_huge_pages(seg: Mapping) -> bool:
    """Ask for transparent huge pages on the segment where the host allows them; say so once if not."""
    mode = thp_shmem_mode()
    if mode in ("always", "within_size", "force"):
        return True
    if mode == "advise" and madvise(seg.addr, seg.size, MADV_HUGEPAGE) == 0:
        return True
    logger.info("segment uses 4 KiB pages: transparent huge pages for shared memory are %s on this host "
                "(%s; 'advise' or 'within_size' would enable them)", mode or "unavailable", THP_SHMEM)
    return False


class Prefault:
    """Faults ``seg`` in on a daemon thread; ``done`` is set when every page is in (or it stopped)."""

    def __init__(self, seg: Mapping) -> None:
        self.seg = seg
        self.done = threading.Event()
        self.finished_at = 0.0          # time.monotonic() when the last page was in (0: not yet)
        self.method = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memcache-prefault", daemon=True)

    def start(self) -> Prefault:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0, seg = time.monotonic(), self.seg
        try:
            for off in range(0, seg.size, SLICE):
                if self._stop.is_set():
                    return
                self._populate(seg.addr + off, min(SLICE, seg.size - off))
            self.finished_at = time.monotonic()
            logger.info("segment pre-faulted: %d MiB in %.2f s (%s)", seg.size >> 20, self.finished_at - t0,
                        self.method)
        except Exception:   # never fatal: the segment just stays cold
            logger.exception("pre-faulting the segment failed; its pages are faulted in by the first puts")
        finally:
            self.done.set()

    def _populate(self, addr: int, n: int) -> None:
        if self.method != "touch" and madvise(addr, n, MADV_POPULATE_WRITE) == 0:
            self.method = "MADV_POPULATE_WRITE"
            return
        self.method = "touch"           # kernels before 5.14: read one byte per page (numpy's loop, no GIL)
        int(array_at(addr, n)[::PAGE].sum())

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def start_prefault(seg: Mapping, cfg: LocalConfig) -> Prefault | None:
    """Huge pages (``segment_hugepages``) and the background pre-fault (``segment_prefault``: "auto" is
    off here; ``memcache local-service`` turns it on) of a fresh segment."""
    if cfg.segment_hugepages:
        ask_huge_pages(seg)
    return Prefault(seg).start() if cfg.segment_prefault == "on" else None
