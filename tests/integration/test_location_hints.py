"""Early copies from remembered places (``local/hints.py``): a get of keys this client looked up before
copies them while its ``Lookup`` is on the way, and keeps the copy only where the reply names the
same object at the same place. Real MetaService process, real segments; a writer that holds the
segment and a reader that holds none, as an engine reading a provider's objects, on ``host_shm``
(the reader maps the segment) and ``host_tcp`` (it reads through the writer's data server).

Each test reads the ``memcache_local_early_reads`` counter, so it proves which way the get went: an
early copy used, or one thrown away.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from memcache_core import DistributedObjectStore, LocalConfig, errors
from memcache_core import protocol as p
from memcache_core.config import HostProtocol
from memcache_core.layout import payload_offset
from memcache_core.local.hints import PROBE_EVERY
from memcache_core.rpc import expect
from memcache_core.testing import MetaServiceProcess, mapped_segment, running_meta_service, started, wait_for

pytestmark = pytest.mark.integration

SIZE = 256 << 10
LEASE_MS = 300


class Client:
    """A store in this process with one registered buffer of ``slots`` objects."""

    def __init__(self, ms: MetaServiceProcess, protocol: HostProtocol, holds_segment: bool, slots: int = 4,
                 dram_size: int = 8 << 20, **cfg: Any) -> None:
        conf = LocalConfig(meta_service_url=ms.meta_service_url, config_store_url=ms.config_store_url,
                           protocol=protocol, dram_size=dram_size, hcom_url="tcp://127.0.0.1:0",
                           client_timeout_seconds=2, log_level="warning", **cfg)
        self.store = DistributedObjectStore()
        assert self.store.setup(conf) == 0 and self.store.init(0, init_bm=holds_segment) == 0
        self.buf = np.zeros(slots * SIZE, dtype=np.uint8)
        assert self.store.register_buffer(self.buf.ctypes.data, self.buf.nbytes) == 0

    def slot(self, k: int) -> int:
        return self.buf.ctypes.data + k * SIZE

    def put(self, keys: list[str], values: list[bytes]) -> list[int]:
        for k, v in enumerate(values):
            self.buf[k * SIZE:(k + 1) * SIZE] = np.frombuffer(v, dtype=np.uint8)
        return self.store.batch_put_from(keys, [self.slot(k) for k in range(len(keys))], [SIZE] * len(keys))

    def get(self, keys: list[str]) -> tuple[list[int], list[bytes]]:
        self.buf[:] = 0
        codes = self.store.batch_get_into(keys, [self.slot(k) for k in range(len(keys))], [SIZE] * len(keys))
        return codes, [self.buf[k * SIZE:(k + 1) * SIZE].tobytes() for k in range(len(keys))]

    def early(self) -> dict[str, float]:
        counter = self.store._service().metrics.early_reads
        return {o: counter.labels(o)._value.get() for o in ("used", "discarded")}

    def close(self) -> None:
        self.store.close()


def value(tag: str) -> bytes:
    return np.random.default_rng(abs(hash(tag)) % (1 << 32)).bytes(SIZE)


def where(ms: MetaServiceProcess, key: str) -> tuple[int, int, int]:
    """(segment id, offset, generation) of the key's object, as the MetaService holds it now."""
    rpc = ms.rpc(5.0)
    try:
        f = expect(rpc.call(p.Lookup([key], lease=False), idempotent=True), p.LookupReply).results[0]
    finally:
        rpc.close()
    assert f is not None
    return f.locations[0].segment_id, f.locations[0].offset, f.generation


def put_at(ms: MetaServiceProcess, writer: Client, key: str, data: bytes, place: tuple[int, int, int]) -> None:
    """Put ``key`` so that its object lands at ``place`` (segment, offset), where a removed object was:
    the precondition of the tests below, established rather than assumed. The old space comes free
    once the reader's lease on it ends (a MetaService on a loaded host may take longer to see that);
    until then each put lands elsewhere and is removed again (an unleased object frees at once)."""
    def landed() -> bool:
        assert writer.put([key], [data]) == [0]
        if where(ms, key)[:2] == place[:2]:
            return True
        assert writer.store.remove(key) == 0
        return False
    wait_for(landed, 30.0, f"a put of {key!r} to land at segment {place[0]} offset {place[1]}",
             interval_s=LEASE_MS / 1000)


@pytest.fixture(params=["host_shm", "host_tcp"])
def pool(request: pytest.FixtureRequest) -> Iterator[tuple[MetaServiceProcess, Any]]:
    """The reader copies early out of shared memory, or through the writer's data server."""
    with running_meta_service(lease_ttl_ms=LEASE_MS, heartbeat_timeout_ms=10_000) as ms:   # no death wanted here
        with started(lambda holds, **cfg: Client(ms, request.param, holds, **cfg), Client.close) as start:
            yield ms, start


def test_a_get_of_remembered_keys_copies_early_and_is_byte_exact(pool):
    ms, start = pool
    writer, reader = start(True), start(False)
    keys = [f"hot/{i}" for i in range(4)]
    assert writer.put(keys, [value(k) for k in keys]) == [0] * 4
    codes, got = reader.get(keys)                            # the first get: nothing remembered yet
    assert codes == [0] * 4 and got == [value(k) for k in keys]
    assert reader.early() == {"used": 0, "discarded": 0}
    for n in (1, 2):
        codes, got = reader.get(keys)
        assert codes == [0] * 4 and got == [value(k) for k in keys]
        assert reader.early() == {"used": 4 * n, "discarded": 0}
    codes, got = reader.get(keys[:2] + ["never-put"])        # a mix: remembered keys and a miss
    assert codes[:2] == [0, 0] and codes[2] == errors.OBJECT_NOT_EXISTS and got[:2] == [value(k) for k in keys[:2]]
    assert reader.early() == {"used": 10, "discarded": 0}


def test_off_copies_nothing_early(pool):
    _, start = pool
    writer, reader = start(True), start(False, location_hints=0)
    assert writer.put(["k"], [value("k")]) == [0]
    for _ in range(2):
        codes, got = reader.get(["k"])
        assert codes == [0] and got == [value("k")]
    assert reader.early() == {"used": 0, "discarded": 0}


def test_a_key_removed_since_is_a_miss(pool):
    """Another client removes the key after this one remembered it: the space is still leased and
    holds the old bytes, which the early copy reads; the reply says the key is gone: a miss."""
    _, start = pool
    writer, reader = start(True), start(False)
    assert writer.put(["gone"], [value("gone")]) == [0]
    assert reader.get(["gone"])[0] == [0]
    assert writer.store.remove("gone") == 0
    codes, _ = reader.get(["gone"])
    assert codes == [errors.OBJECT_NOT_EXISTS]
    assert reader.early() == {"used": 0, "discarded": 1}


@pytest.mark.parametrize("verify_ratio", [1.0, 0.0])
def test_new_bytes_at_the_same_place_are_read_from_the_reply_not_taken_from_the_early_copy(pool, verify_ratio):
    """The key is removed and put again with other bytes, and lands where the remembered object was.
    With checksums not verified (ratio 0) only the generation tells the objects apart; the early copy
    (a mix of old and new bytes, or the new ones) is thrown away and the key read as the reply says."""
    ms, start = pool
    writer, reader = start(True), start(False, checksum_verify_ratio=verify_ratio)
    assert writer.put(["k"], [value("old")]) == [0]
    assert reader.get(["k"])[0] == [0]
    before = where(ms, "k")
    assert writer.store.remove("k") == 0
    put_at(ms, writer, "k", value("new"), before)               # once the reader's lease ended
    assert where(ms, "k")[2] != before[2]
    codes, got = reader.get(["k"])
    assert codes == [0] and got == [value("new")]
    assert reader.early() == {"used": 0, "discarded": 1}
    codes, got = reader.get(["k"])                              # the reply's place is remembered now
    assert codes == [0] and got == [value("new")]
    assert reader.early() == {"used": 1, "discarded": 1}


def test_another_key_in_the_place_of_a_removed_one_is_never_read_for_it(pool):
    ms, start = pool
    writer, reader = start(True), start(False, checksum_verify_ratio=0.0)
    assert writer.put(["a"], [value("a")]) == [0]
    assert reader.get(["a"])[0] == [0]
    place = where(ms, "a")
    assert writer.store.remove("a") == 0
    put_at(ms, writer, "b", value("b"), place)
    codes, _ = reader.get(["a"])
    assert codes == [errors.OBJECT_NOT_EXISTS]
    assert reader.early() == {"used": 0, "discarded": 1}


def test_a_lookup_that_fails_makes_the_early_copy_a_miss(pool):
    """The MetaService is gone: the early copy reads the right bytes, but with no reply to confirm
    them the get fails; it never reports success from the copy alone."""
    ms, start = pool
    writer, reader = start(True), start(False)
    assert writer.put(["k"], [value("k")]) == [0]
    assert reader.get(["k"])[0] == [0]
    ms.stop()
    t = time.monotonic()
    codes, _ = reader.get(["k"])
    assert codes[0] != 0
    assert time.monotonic() - t < 10
    assert reader.early()["used"] == 0


def test_keys_put_again_before_every_get_stop_the_early_copies(pool):
    """Churn: the writer replaces the objects before each get (as bench_store.py does). Early copies
    would all be thrown away, each a copy for nothing: after a few the reader stops copying early and
    tries again one get in PROBE_EVERY. Every get still reads the newest bytes."""
    _, start = pool
    writer, reader = start(True, dram_size=64 << 20), start(False, checksum_verify_ratio=0.0)
    keys = ["c/0", "c/1"]   # removed objects keep their space while the reader's lease runs: room for all
    gets = 40
    for n in range(gets):
        vals = [value(f"{k}/{n}") for k in keys]
        assert writer.put(keys, vals) == [0, 0]
        codes, got = reader.get(keys)
        assert codes == [0, 0] and got == vals
        assert writer.store.remove_batch(keys) == [0, 0]
    assert reader.early()["used"] == 0
    assert 2 <= reader.early()["discarded"] <= 2 * (3 + gets // PROBE_EVERY)


class Draws:
    """The reader's checksum sampler, drawing the given numbers in turn (then never verifying)."""

    def __init__(self, *draws: float) -> None:
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0) if self.draws else 1.0


def test_an_early_copy_that_fails_its_checksum_makes_the_read_after_it_verified(pool):
    """Checksums are sampled (ratio 0.5): the early copy draws a verification and finds the bytes
    corrupt; the reply confirms it read that very object. The read after it would draw no
    verification, and would return the corrupt bytes as a hit: it is verified anyway, the object is
    reported corrupt, and the get is a miss."""
    ms, start = pool
    writer, reader = start(True), start(False, checksum_verify_ratio=0.5)
    assert writer.put(["k"], [value("k")]) == [0]
    svc = reader.store._service()
    svc._sample = Draws(1.0)                      # the first get (no early copy) is not verified
    assert reader.get(["k"]) == ([0], [value("k")])
    sid, offset, _ = where(ms, "k")
    with mapped_segment(ms.segment(sid).shm_path) as m:
        m[payload_offset(offset) + 1234] ^= 0xFF
    svc._sample = Draws(0.0, 1.0)                 # the early copy verified, the read after it not
    codes, _ = reader.get(["k"])
    assert codes == [errors.CHECKSUM_MISMATCH]
    assert svc.integrity_failures == 1
    assert reader.early() == {"used": 0, "discarded": 1}
    wait_for(lambda: reader.get(["k"])[0] == [errors.OBJECT_NOT_EXISTS], 5.0, "the corrupt object dropped")
