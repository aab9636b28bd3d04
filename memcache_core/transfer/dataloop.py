"""The native request loop of the data server (``dataloop.c``): a plain-TCP connection's reads answered in C.

The library is built at install time when a C compiler is present (an optional extension, setup.py)
and loaded with ctypes, which releases the GIL for the whole foreign call. ``DataServer`` hands a
connection to ``serve`` after its handshake; the call returns with a request that is not a plain
read it can answer (a write, a disk op, a read of more than ``RANGES`` ranges, a segment id it does
not find, ranges out of bounds, a failed MAC, another magic), with the bytes of it read so far and the session's counters where Python goes on
from them, or when the connection ends, or now and then so the owner's served counts stay current.
A self-test at load compares the library's MAC with hashlib's; where it fails or the library was not
built, ``load`` returns None and the server runs its Python loop (``data_server_loop``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading

from .. import nativelib
from ..auth import Session

logger = logging.getLogger(__name__)

COUNT, HANDBACK, CLOSED, TIMEOUT, ERROR = 0, 1, 2, 3, 4   # mc_dataloop_serve's answers
RANGES = 64        # the most ranges (objects) of a read answered in C (MC_DL_RANGES): one sendmsg
IDS = 64           # segment ids in the table the loop reads (the newest ones; older ones go to Python)
MAX_READS = 256    # reads served before a return (their counts reach the owner)
QUIET_MS = 20      # served reads are counted once the connection was quiet this long...
COUNT_MS = 200     # ...or this long after the first of them

class State(ctypes.Structure):
    _fields_ = [("sent", ctypes.c_uint64), ("received", ctypes.c_uint64), ("reads", ctypes.c_uint64),
                ("bytes", ctypes.c_uint64), ("got", ctypes.c_uint64), ("err", ctypes.c_int64)]


class SegmentIds:
    """The segment ids the loop serves, in memory it reads while it runs: a count, then up to ``IDS``
    ids. Only ids of the segment are ever written in (the newest ``IDS``: an older one is found by
    Python, whose set holds them all), so a torn or stale read only hands a request to Python."""

    def __init__(self) -> None:
        self.table = (ctypes.c_uint64 * (1 + IDS))()
        self._lock = threading.Lock()

    def add(self, segment_id: int) -> None:
        with self._lock:
            n = self.table[0]
            self.table[1 + n % IDS] = segment_id
            self.table[0] = n + 1


class DataLoop:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        u64, p = ctypes.c_uint64, ctypes.c_void_p
        lib.mc_dataloop_state_size.restype = u64
        lib.mc_dataloop_buf_size.restype = u64
        if lib.mc_dataloop_state_size() != ctypes.sizeof(State):
            raise AssertionError(f"the library's state is {lib.mc_dataloop_state_size()} bytes, not "
                                 f"{ctypes.sizeof(State)}")
        self.buf_size = int(lib.mc_dataloop_buf_size())
        self._mac = lib.mc_dataloop_mac
        self._mac.argtypes = [ctypes.c_char_p, u64, u64, ctypes.c_char_p, u64, u64, p, u64]
        self._mac.restype = ctypes.c_int
        self._serve = lib.mc_dataloop_serve
        self._serve.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, u64, u64, p, u64, p, ctypes.c_char_p,
                                ctypes.c_int, ctypes.c_int, ctypes.c_int, u64, ctypes.POINTER(State), p, u64]
        self._serve.restype = ctypes.c_int

    def mac(self, key: bytes, seq: int, data: bytes, split: int = 0, size: int = 16) -> bytes:
        """The MAC of ``data`` as ``auth.Session`` makes it (fed in two parts cut at ``split``)."""
        out = ctypes.create_string_buffer(size)
        if self._mac(key, len(key), seq, data, len(data), split, out, size) != 0:
            raise ValueError("mc_dataloop_mac: bad arguments")
        return out.raw

    def serve(self, fd: int, session: Session, segment: int, size: int, ids: SegmentIds, magic: bytes,
              idle_s: float, buf: ctypes.Array) -> tuple[int, State]:
        """Serve ``fd`` (the answer code and the state: counts, bytes of a handed-back request in
        ``buf``); the session's counters are taken from it and given back to it."""
        send_key, recv_key, sent, received = session.native_state()
        st = State(sent, received)
        tag = session.size
        code = self._serve(fd, send_key, recv_key, len(send_key), tag, segment, size, ctypes.addressof(ids.table),
                           magic, max(1, int(idle_s * 1000)), QUIET_MS, COUNT_MS, MAX_READS, ctypes.byref(st),
                           ctypes.addressof(buf), len(buf))
        session.resume(st.sent, st.received)
        if code > ERROR:
            raise ValueError(f"mc_dataloop_serve: bad arguments ({code})")
        return code, st


def _load() -> DataLoop | None:
    found = nativelib.find(os.path.dirname(os.path.abspath(__file__)), "_dataloop")
    if found is None:
        logger.info("native data-server loop not built (no C compiler at install?): the data server runs "
                    "its Python loop (data_server_loop, docs/configuration.md)")
        return None
    try:
        loop = DataLoop(ctypes.CDLL(found))
        _self_test(loop)
        return loop
    except (OSError, AttributeError, AssertionError, ValueError) as e:
        logger.warning("native data-server loop not usable (%s): the data server runs its Python loop", e)
        return None


def _self_test(loop: DataLoop) -> None:
    """MACs of frames across the block size, against hashlib's keyed BLAKE2b."""
    key = bytes(range(1, 33))
    for n in (0, 12, 49, 128, 129, 1057):
        data = bytes((i * 7) & 0xFF for i in range(n))
        want = hashlib.blake2b((n * 977).to_bytes(8, "little") + data, key=key, digest_size=16).digest()
        if loop.mac(key, n * 977, data, n // 3) != want:
            raise AssertionError(f"self-test: the MAC of {n} bytes differs from hashlib's")


load = nativelib.once(_load)
"""The native loop, or None where it was not built or fails its self-test."""
