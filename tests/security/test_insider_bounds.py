"""An insider (a process holding the pool secret, a member) against the control plane's single loop:
the keys one request may carry are bounded (protocol.MAX_KEYS), an honest member's heartbeats and
small requests are answered while an insider sends maximal requests, and the puts a member may hold
in flight are bounded by the MetaService's quotas (-3112)."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time

import pytest

from memcache_core import DistributedObjectStore, errors
from memcache_core import protocol as p
from memcache_core.testing import MetaServiceProcess, running_meta_service, wait_for
from tests.integration.stores import HEARTBEAT_TIMEOUT_MS
from tests.security.wire import addr_of, ask, authed

pytestmark = pytest.mark.integration


def _insider(meta: MetaServiceProcess) -> tuple[socket.socket, int, bytes]:
    """A raw control connection that joined as a member (no segment): socket, client id, token."""
    s = authed(addr_of(meta.meta_service_url))
    j = ask(s, p.Join(0, "insider", os.getpid()))
    assert isinstance(j, p.Joined), j
    return s, j.client_id, j.token


def test_maximal_requests_of_an_insider_do_not_starve_an_honest_member(meta):
    """Scenario: before, one Alloc of 1M one-byte keys held the single loop 17.7 s and an honest member
    was declared dead meanwhile. Now a request carries at most MAX_KEYS keys (one more: refused, the
    connection still answered); an insider sending maximal Allocs and Aborts back to back for several
    rounds leaves the honest member's heartbeats answered (same member id, never declared dead within
    the fixture's heartbeat timeout) and its is_exist answered within that timeout every time (the
    timeout is 10 s, not 1.5 s: a loaded machine can stall a live process that long, while the loop
    held 17.7 s before)."""
    store = DistributedObjectStore()
    assert store.setup(meta.local_config(heartbeat_interval_ms=200, dram_size="256MB")) == 0
    assert store.init(0, True) == 0
    s, cid, token = _insider(meta)
    try:
        assert store.put("honest", b"h" * 512) == 0
        member = store.get_local_service_id()
        too_many = ask(s, p.Alloc(cid, token, [f"x{i}" for i in range(p.MAX_KEYS + 1)], [1] * (p.MAX_KEYS + 1)))
        assert isinstance(too_many, p.Error) and too_many.code == errors.INVALID_PARAM, too_many
        assert str(p.MAX_KEYS) in too_many.message

        lat: list[float] = []
        done = threading.Event()

        def honest() -> None:
            while not done.is_set():
                t = time.perf_counter()
                assert store.is_exist("honest") == 1
                lat.append(time.perf_counter() - t)

        reader = threading.Thread(target=honest)
        reader.start()
        insider: list[float] = []
        try:
            for r in range(6):
                keys = [f"{r}-{i}" for i in range(p.MAX_KEYS)]
                assert isinstance(ask(s, p.Heartbeat(cid, token)), p.HeartbeatReply)   # the insider stays a member
                t = time.perf_counter()
                got = ask(s, p.Alloc(cid, token, keys, [1] * len(keys)))
                insider.append(time.perf_counter() - t)
                assert isinstance(got, p.AllocReply) and len(got.results) == len(keys)
                ok = [(k, a.generation) for k, a in zip(keys, got.results, strict=True) if a.code == 0]
                assert ok, "the insider's maximal Alloc placed nothing: the test measures nothing"
                t = time.perf_counter()
                assert isinstance(ask(s, p.Abort(cid, token, [k for k, _ in ok], [g for _, g in ok])), p.Ok)
                insider.append(time.perf_counter() - t)
        finally:
            done.set()
            reader.join()
        worst = max(lat)
        print(f"insider's maximal requests ({p.MAX_KEYS} keys): longest {max(insider) * 1e3:.0f} ms; honest "
              f"is_exist during them: {len(lat)} calls, p50 {sorted(lat)[len(lat) // 2] * 1e3:.1f} ms, "
              f"worst {worst * 1e3:.0f} ms")
        assert len(lat) >= len(insider), "the honest member was not answered between the insider's requests"
        assert worst < HEARTBEAT_TIMEOUT_MS / 1000, f"an honest is_exist waited {worst:.2f} s: a heartbeat timeout"
        assert store.get_local_service_id() == member, "the honest member was declared dead and re-joined"
        assert store.get("honest") == b"h" * 512
    finally:
        s.close()
        store.close()


def test_a_batch_larger_than_one_request_is_split_by_the_local_service(meta):
    """The bound is the wire's, not the engine's: batch calls of MAX_KEYS + 3 keys (put, exist, get,
    remove) work and are byte-exact, the LocalService sending them as two requests each."""
    store = DistributedObjectStore()
    assert store.setup(meta.local_config(dram_size="512MB")) == 0
    assert store.init(0, True) == 0
    try:
        n = p.MAX_KEYS + 3
        keys = [f"big-{i}" for i in range(n)]
        values = [i.to_bytes(4, "little") * 4 for i in range(n)]
        assert store.put_batch(keys, values) == 0
        assert store.batch_is_exist(keys + ["absent"]) == [1] * n + [0]
        assert store.get_batch(keys) == values
        assert store.remove_batch(keys) == [0] * n
        assert store.batch_is_exist(keys) == [0] * n
    finally:
        store.close()


def test_a_member_holds_at_most_its_quota_of_puts_in_flight():
    """Scenario: an insider allocates and never commits, pinning space nobody can evict. The MetaService
    bounds each member's uncommitted objects and their bytes (member_max_pending_objects,
    member_max_pending_bytes): past them its Alloc is refused with -3112, other members are not
    affected, and the quota comes back as its puts are aborted."""
    with running_meta_service(member_max_pending_objects=8, member_max_pending_bytes=64 << 10) as meta:
        store = DistributedObjectStore()
        # two-phase puts: a small put through the writer's arena is never in flight at the MetaService
        # (one ArenaCommit; what it holds is bounded by arena_bytes), so it is not what this quota bounds
        assert store.setup(meta.local_config(dram_size="64MB", small_put_max_bytes=0)) == 0
        assert store.init(0, True) == 0
        s, cid, token = _insider(meta)
        try:
            keys = [f"pin-{secrets.token_hex(4)}-{i}" for i in range(10)]
            got = ask(s, p.Alloc(cid, token, keys, [100] * 10))
            assert isinstance(got, p.AllocReply)
            assert [r.code for r in got.results] == [0] * 8 + [errors.QUOTA_EXCEEDED] * 2
            # the honest member's puts are its own: a batch of 8 (its whole quota at once) is stored
            assert store.put_batch([f"honest-{i}" for i in range(8)], [b"v" * 100] * 8) == 0
            # one more put of the honest member past its quota is refused, naming the settings
            code = store.put_batch([f"over-{i}" for i in range(9)], [b"v" * 100] * 9)
            assert code == errors.QUOTA_EXCEEDED
            assert store.batch_is_exist([f"over-{i}" for i in range(9)]) == [1] * 8 + [0]
            placed = [(k, r.generation) for k, r in zip(keys, got.results, strict=True) if r.code == 0]
            assert isinstance(ask(s, p.Abort(cid, token, [k for k, _ in placed], [g for _, g in placed])), p.Ok)
            # bytes: 64 KiB in flight at most (times replicas)
            big = ask(s, p.Alloc(cid, token, ["b1", "b2"], [40 << 10, 40 << 10]))
            assert isinstance(big, p.AllocReply)
            assert [r.code for r in big.results] == [0, errors.QUOTA_EXCEEDED]
            msg = str(errors.error_from_code(errors.QUOTA_EXCEEDED, "cannot put 'b2'"))
            assert "member_max_pending_objects" in msg and "member_max_pending_bytes" in msg
        finally:
            s.close()
            store.close()


def _hold(meta: MetaServiceProcess, source: str, tries: int) -> list[socket.socket]:
    """Open ``tries`` authenticated control connections from ``source``; those the server kept."""
    held: list[socket.socket] = []
    for _ in range(tries):
        try:
            held.append(authed(addr_of(meta.meta_service_url), source=source))
        except (OSError, errors.MemCacheError):
            pass   # refused: closed before or during the handshake
    return held


def test_an_insider_holding_its_connections_per_address_leaves_room_and_answers_for_others():
    """Scenario: an insider (holding the secret) opens every control connection it can from one
    address (127.0.0.2) and keeps sending maximal Exists on them. At most max_connections_per_address
    are kept; an honest member from another address still joins and its is_exist is answered, right,
    every time within the deadline. Negative control: with the cap at max_connections the insider's
    connections take every slot and the same member cannot join."""
    with running_meta_service(max_connections=64, max_connections_per_address=64) as meta:
        held = _hold(meta, "127.0.0.2", 64)
        try:
            assert len(held) == 64, "the insider could not fill the slots: the control shows nothing"
            store = DistributedObjectStore()
            assert store.setup(meta.local_config(client_timeout_seconds=2, dram_size="0")) == 0
            assert store.init(0, False) == errors.META_NOT_CONNECTED   # every slot is the insider's
        finally:
            for s in held:
                s.close()
    # The default heartbeat_timeout_ms: the honest member must not be declared dead for a loaded
    # machine's pause; its heartbeats still have to get through the flood, or its object is lost.
    with running_meta_service(max_connections=64, max_connections_per_address=16) as meta:
        held = _hold(meta, "127.0.0.2", 64)
        assert len(held) == 16, len(held)
        done = threading.Event()
        keys = [f"probe-{i}" for i in range(p.MAX_KEYS)]

        def insist(s: socket.socket) -> None:
            while not done.is_set():
                assert isinstance(ask(s, p.Exist(keys)), p.Flags)

        insiders = [threading.Thread(target=insist, args=(s,), daemon=True) for s in held]
        store = DistributedObjectStore()
        try:
            for t in insiders:
                t.start()
            assert store.setup(meta.local_config(heartbeat_interval_ms=200)) == 0
            assert store.init(0, True) == 0
            assert store.put("honest", b"h" * 256) == 0
            lat = []
            for _ in range(30):
                t0 = time.perf_counter()
                assert store.is_exist("honest") == 1 and store.is_exist("absent") == 0
                lat.append(time.perf_counter() - t0)
            print(f"honest is_exist pairs while 16 insider connections send {p.MAX_KEYS}-key Exists: "
                  f"p50 {sorted(lat)[15] * 1e3:.0f} ms, worst {max(lat) * 1e3:.0f} ms")
            assert max(lat) < 5.0, f"an honest is_exist pair took {max(lat):.2f} s"
            assert store.get("honest") == b"h" * 256
        finally:
            done.set()
            for t in insiders:
                t.join(10)
            for s in held:
                s.close()
            store.close()


def _kept(meta: MetaServiceProcess, cid: int) -> tuple[int, int] | None:
    for m in meta.http("/api/v1/stats")["members"]:
        if m["client_id"] == cid:
            return m["kept_objects"], m["kept_bytes"]
    return None


def test_a_join_reports_objects_in_bounded_requests_counted_against_the_joiner():
    """Scenario: an insider joins with a segment announced as 4 TiB. Before, a Join carried any number
    of reported objects (200,000 joined in 1-4 s, 1,000,000 held the loop 23-41 s and an honest member
    was declared dead) and none counted against the joiner, which then allocated past its
    ``member_max_objects``. Now a Join carries at most MAX_KEYS reports (one more: refused by the
    decoder, the connection answered); the rest follow in ``Report`` requests of the same bound, the
    honest member answered between them; the reported objects count against the joiner, those past
    its quota (500 here) are refused, and its puts keep it at the quota."""
    quota = 500
    with running_meta_service(member_max_objects=quota, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS) as meta:
        store = DistributedObjectStore()
        assert store.setup(meta.local_config(heartbeat_interval_ms=200)) == 0
        assert store.init(0, True) == 0
        s = authed(addr_of(meta.meta_service_url))
        try:
            member = store.get_local_service_id()
            assert store.put("honest", b"h" * 512) == 0
            seg = p.SegmentInfo(0, 4 << 40, "insider", f"/dev/shm/memcache-{os.getpid()}-{secrets.token_hex(6)}",
                                "127.0.0.1:9")
            reports = [p.ObjectReport(f"r{i}", i * 4096, 1024, 1 + i, 0) for i in range(3 * p.MAX_KEYS + 1)]
            too_many = ask(s, p.Join(0, "insider", os.getpid(), seg, reports[:p.MAX_KEYS + 1]))
            assert isinstance(too_many, p.Error) and too_many.code == errors.INVALID_PARAM, too_many
            assert meta.http("/get_all_keys")["keys"] == ["honest"], "the refused Join left objects"
            k = p.MAX_KEYS
            j = ask(s, p.Join(0, "insider", os.getpid(), seg, reports[:k], more=True))
            assert isinstance(j, p.Joined), j
            for i in range(1, 4):
                got = ask(s, p.Report(j.client_id, j.token, reports[i * k:(i + 1) * k], last=i == 3))
                assert isinstance(got, p.Ok), got
                assert store.is_exist("honest") == 1   # answered between the insider's requests
            assert _kept(meta, j.client_id) == (quota, quota * 1024)
            assert len(meta.http("/get_all_keys")["keys"]) == quota + 1
            got = ask(s, p.Alloc(j.client_id, j.token, ["more"], [1024]))
            assert isinstance(got, p.AllocReply) and got.results[0].code == 0, got
            assert isinstance(ask(s, p.Commit(j.client_id, j.token, ["more"], [got.results[0].generation], [])), p.Codes)
            assert _kept(meta, j.client_id) == (quota, quota * 1024), "the joiner keeps more than its quota"
            assert store.get_local_service_id() == member and store.get("honest") == b"h" * 512
        finally:
            s.close()
            store.close()


def test_an_honest_provider_with_more_objects_than_one_request_recovers_them_all_after_a_restart():
    """Scenario: a provider holds 3 x MAX_KEYS + 5 objects; the MetaService restarts. The provider
    re-joins with the first MAX_KEYS and reports the rest in bounded ``Report`` requests: every object
    is back, byte-exact, counted against the provider, and the segment takes new objects once the
    last report is in."""
    with running_meta_service(heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS, lease_ttl_ms=500) as meta:
        store = DistributedObjectStore()
        assert store.setup(meta.local_config(heartbeat_interval_ms=200, dram_size="64MB")) == 0
        assert store.init(0, True) == 0
        try:
            keys = [f"p{i}" for i in range(3 * p.MAX_KEYS + 5)]
            values = [i.to_bytes(4, "little") * 64 for i in range(len(keys))]
            assert store.put_batch(keys, values) == 0
            meta.stop()
            meta.start()
            wait_for(lambda: len(meta.http("/get_all_keys")["keys"]) == len(keys), 60,
                     "the provider to re-join and report all its objects")
            assert store.batch_is_exist(keys) == [1] * len(keys)
            assert store.get_batch(keys) == values
            assert _kept(meta, store.get_local_service_id()) == (len(keys), len(keys) * 256)

            def stored() -> bool:   # a re-joined segment takes new objects once older leases would end
                code = store.put("after", b"a" * 1024)
                assert code in (0, errors.OUT_OF_MEMORY), code
                return code == 0
            wait_for(stored, 15, "the re-joined segment to take new objects")
        finally:
            store.close()
