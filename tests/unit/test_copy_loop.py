"""The native copy loop (transfer/copyloop.c through native.py) on its own: bytes and XXH3-64 digests
against xxhash's, for reads and writes, pieces of odd sizes, slices that do not divide them, and an
object's stream cut in byte ranges hashed in order (as shmloop.py cuts one large object)."""

from __future__ import annotations

import ctypes
import random
from array import array
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import xxhash

from memcache_core.config import LocalConfig
from memcache_core.errors import ChecksumMismatch, ConfigError
from memcache_core.layout import payload_offset
from memcache_core.protocol import SegmentInfo
from memcache_core.transfer import native
from memcache_core.transfer.engine import CopyOp, TransferEngine
from memcache_core.transfer.native import ALL, COPY, DIGEST, DIGEST_AT, HASH, READ, RESET, ROW, flat_pieces
from memcache_core.transfer.shmloop import MIN_CUT, copy_native


@pytest.fixture(scope="module")
def loop() -> native.NativeLoop:
    got = native.load()
    assert got is not None, "the native copy loop was not built (pip install -e . needs a C compiler)"
    return got


def _layout(rng: random.Random, total: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """A caller buffer and pieces of random sizes laid over it in shuffled order, with gaps."""
    sizes, left = [], total
    while left:
        sizes.append(min(left, rng.choice([1, 7, 4096, 4097, 16 << 10, 65537, 128 << 10, 300_001])))
        left -= sizes[-1]
    buf = np.zeros(total + 64 * len(sizes), np.uint8)
    order = list(range(len(sizes)))
    rng.shuffle(order)
    at, starts = 0, [0] * len(sizes)
    for k in order:
        starts[k], at = at, at + sizes[k] + 64
    return buf, [(buf.ctypes.data + starts[k], sizes[k]) for k in range(len(sizes))]


def _gather(pieces: list[tuple[int, int]]) -> bytes:
    return b"".join(ctypes.string_at(p, n) for p, n in pieces)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("reading", [True, False])
def test_bytes_and_digests_match_xxhash(loop: native.NativeLoop, seed: int, reading: bool) -> None:
    rng = random.Random(seed)
    data = [rng.randbytes(n) for n in (0, 1, 70_001, 1_234_567)]
    seg = np.zeros(sum(len(d) for d in data), np.uint8)
    layouts = [_layout(rng, len(d)) for d in data]
    rows, first, at = [], 0, 0
    for d, (_, ps) in zip(data, layouts, strict=True):
        if reading:
            seg[at:at + len(d)] = np.frombuffer(d, np.uint8)
        else:
            src, off = memoryview(d), 0
            for p, n in ps:
                ctypes.memmove(p, bytes(src[off:off + n]), n)
                off += n
        rows.append((seg.ctypes.data + at, first, len(ps), 0, ALL,
                     (READ if reading else 0) | COPY | HASH | RESET | DIGEST, 0))
        first, at = first + len(ps), at + len(d)
    flat = array("Q", [v for row in rows for v in row])
    loop.run(flat_pieces([ps for _, ps in layouts]), flat, rng.choice([1000, 16 << 10, 64 << 10]))
    at = 0
    for k, (d, (_, ps)) in enumerate(zip(data, layouts, strict=True)):
        assert flat[k * ROW + DIGEST_AT] == xxhash.xxh3_64_intdigest(d)
        assert (_gather(ps) if reading else seg[at:at + len(d)].tobytes()) == d
        at += len(d)


def test_a_stream_cut_in_ranges_is_hashed_in_order(loop: native.NativeLoop) -> None:
    """Ranges copied on their own (no hash) and hashed afterwards, in order, with one state."""
    rng = random.Random(7)
    d = rng.randbytes(3_000_017)
    seg = np.frombuffer(d, np.uint8).copy()
    _, ps = _layout(rng, len(d))
    pieces = flat_pieces([ps])
    cuts = [0, 4096 * 100, 4096 * 500, len(d)]
    for k in range(3):   # copy each range alone
        loop.run(pieces, array("Q", (seg.ctypes.data, 0, len(ps), cuts[k], cuts[k + 1] - cuts[k], READ | COPY, 0)))
    assert _gather(ps) == d
    for k in range(3):   # then hash the ranges in order on this thread's state
        flags = READ | HASH | (RESET if k == 0 else 0) | (DIGEST if k == 2 else 0)
        row = array("Q", (seg.ctypes.data, 0, len(ps), cuts[k], cuts[k + 1] - cuts[k], flags, 0))
        loop.run(pieces, row)
    assert row[DIGEST_AT] == xxhash.xxh3_64_intdigest(d)


def test_shm_copy_loop_is_validated() -> None:
    with pytest.raises(ConfigError, match="shm_copy_loop"):
        LocalConfig(shm_copy_loop="fast")   # type: ignore[arg-type]   # not one of the choices, on purpose


def test_native_where_it_was_not_built_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """``native`` needs the library; ``auto`` then takes the Python loop."""
    monkeypatch.setattr(native, "load", lambda: None)   # as where it was not built
    with pytest.raises(ConfigError, match="shm_copy_loop"):
        TransferEngine("host_shm", "h", None, 1.0, 1, 1, copy_loop="native")
    engine = TransferEngine("host_shm", "h", None, 1.0, 1, 1, copy_loop="auto")
    assert engine.loop is None
    engine.close()


@pytest.mark.parametrize(("threads", "nobjects"), [(1, 3), (2, 1), (3, 1), (2, 3), (3, 5)])
def test_batches_over_threads_write_and_read_back(loop: native.NativeLoop, threads: int, nobjects: int) -> None:
    """shmloop.copy_native on a segment image in private memory: writes (checksums and headers) then
    reads (verdicts) with whole objects per thread, or one object cut in ranges; a flipped byte in a
    read's source is a ChecksumMismatch for that object only."""
    rng = random.Random(threads * 10 + nobjects)
    sizes = [rng.choice([3 << 20, (5 << 20) + 123, 70_001]) for _ in range(nobjects)]
    sizes[0] = MIN_CUT + 4097                   # big enough to be cut when it is alone
    data = [rng.randbytes(n) for n in sizes]
    seg = np.zeros(sum(payload_offset(0) + n + 64 for n in sizes), np.uint8)
    info = SegmentInfo(1, seg.nbytes, "h", "/dev/shm/memcache-1-00", "127.0.0.1:1")
    bases, offsets, at = {info.shm_path: seg.ctypes.data}, [], 0
    for n in sizes:
        offsets.append(at)
        at += payload_offset(0) + n + 64
    layouts = [_layout(rng, n) for n in sizes]
    for d, (_, ps) in zip(data, layouts, strict=True):
        for (p, n), o in zip(ps, _starts(ps), strict=True):
            ctypes.memmove(p, d[o:o + n], n)
    with ThreadPoolExecutor(max(1, threads - 1)) as pool:
        writes = [CopyOp(info, off, ps, n, f"k{i}", 1, hash=True)
                  for i, (off, (_, ps), n) in enumerate(zip(offsets, layouts, sizes, strict=True))]
        copy_native(loop, writes, bases, False, pool, threads)
        for w, d, off in zip(writes, data, offsets, strict=True):
            assert w.error is None and w.checksum == xxhash.xxh3_64_intdigest(d)
            assert seg[payload_offset(off):payload_offset(off) + len(d)].tobytes() == d
            assert seg[off:off + 8].tobytes() == w.header()[:8]
        for _, ps in layouts:
            for p, n in ps:
                ctypes.memset(p, 0, n)
        seg[payload_offset(offsets[0]) + sizes[0] - 1] ^= 0xFF   # the last byte of the first object
        reads = [CopyOp(info, w.offset, w.pieces, w.nbytes, w.key, 1, w.checksum, hash=True) for w in writes]
        copy_native(loop, reads, bases, True, pool, threads)
    assert isinstance(reads[0].error, ChecksumMismatch)
    for r, d, (_, ps) in list(zip(reads, data, layouts, strict=True))[1:]:
        assert r.error is None and _gather(ps) == d


def _starts(ps: list[tuple[int, int]]) -> list[int]:
    out, at = [], 0
    for _, n in ps:
        out.append(at)
        at += n
    return out
