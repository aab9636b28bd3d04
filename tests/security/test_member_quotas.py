"""What one member keeps in the pool is bounded (``member_max_objects``, ``member_max_bytes``): its
committed objects wherever they lie plus its puts in flight. Past the quota its Alloc is refused with
-3112 and nothing stored is lost; the count follows the table through remove, eviction and the death
of the segment holding the objects; after a MetaService restart or an HA failover the recovered
objects count against no one (segment headers do not name their writer). GVA leases are bounded per
member too (``member_max_leases``)."""

from __future__ import annotations

import functools
import os
import socket
import tempfile

import pytest

from memcache_core import DistributedObjectStore, errors
from memcache_core import protocol as p
from memcache_core.testing import MetaServiceProcess, running_meta_service, wait_for
from tests.integration.stores import StoreProcess
from tests.integration.test_ha import FAILOVER_CODES, TTL_S, Pool
from tests.security.wire import addr_of, ask, authed

pytestmark = pytest.mark.integration


def _kept(meta: MetaServiceProcess, cid: int) -> tuple[int, int] | None:
    """(objects, bytes) the member keeps, as the MetaService's stats report it; None: not a member."""
    for m in meta.http("/api/v1/stats")["members"]:
        if m["client_id"] == cid:
            return m["kept_objects"], m["kept_bytes"]
    return None


def _kept_of_pid(meta: MetaServiceProcess, pid: int) -> tuple[int, int] | None:
    """``_kept`` of the member whose process is ``pid``."""
    for m in meta.http("/api/v1/stats")["members"]:
        if m["pid"] == pid:
            return m["kept_objects"], m["kept_bytes"]
    return None


def _put_raw(s: socket.socket, cid: int, token: bytes, keys: list[str], size: int) -> list[int]:
    """Alloc and commit (no payload written: the count is the MetaService's) as a raw member."""
    got = ask(s, p.Alloc(cid, token, keys, [size] * len(keys)))
    assert isinstance(got, p.AllocReply), got
    ok = [(k, r.generation) for k, r in zip(keys, got.results, strict=True) if r.code == 0]
    if ok:
        done = ask(s, p.Commit(cid, token, [k for k, _ in ok], [g for _, g in ok], []))
        assert isinstance(done, p.Codes) and done.codes == [0] * len(ok), done
    return [r.code for r in got.results]


def test_a_member_keeps_at_most_its_quota_and_a_refused_put_loses_nothing():
    """Scenario: a member puts up to its quota of kept objects and bytes and reads them (leased: none
    can be evicted); one more object, or one too large for the bytes left, is refused with -3112
    naming the settings, everything stored reads back byte-exact and the refused keys are absent;
    removing objects gives the quota back."""
    with running_meta_service(member_max_objects=6, member_max_bytes=6 * 1024 + 512, lease_ttl_ms=120_000) as meta:
        store = DistributedObjectStore()
        assert store.setup(meta.local_config()) == 0
        assert store.init(0, True) == 0
        try:
            cid = store.get_local_service_id()
            values = {f"q{i}": bytes([i]) * 1024 for i in range(5)}
            assert store.put_batch(list(values), list(values.values())) == 0
            assert store.get_batch(list(values)) == list(values.values())   # leased for two minutes
            assert _kept(meta, cid) == (5, 5 * 1024)
            assert store.put("big", b"b" * 2048) == errors.QUOTA_EXCEEDED   # past the bytes
            values["q5"] = b"5" * 1024
            assert store.put("q5", values["q5"]) == 0 and store.get("q5") == values["q5"]
            assert store.put("q6", b"x") == errors.QUOTA_EXCEEDED            # past the objects
            assert store.batch_is_exist(["big", "q6"]) == [0, 0]
            assert store.get_batch(list(values)) == list(values.values())
            assert _kept(meta, cid) == (6, 6 * 1024)
            msg = str(errors.error_from_code(errors.QUOTA_EXCEEDED, "cannot put 'q6'"))
            assert "member_max_objects" in msg and "member_max_bytes" in msg
            assert store.remove_batch(["q0", "q1"]) == [0, 0]
            del values["q0"], values["q1"]
            assert _kept(meta, cid) == (4, 4 * 1024)
            values["q6"] = b"6" * 1024
            assert store.put("q6", values["q6"]) == 0
            assert store.get_batch(list(values)) == list(values.values())
        finally:
            store.close()


def test_at_its_quota_a_member_evicts_its_own_objects_and_a_restart_counts_them_against_their_holder():
    """Scenario: a member at its quota of kept objects puts more: its own least recently used
    unleased objects are evicted to make room (as in a full pool), never another member's, and every
    object left reads back byte-exact. After a MetaService restart the recovered objects are back,
    counted against the member whose segment holds them (segment headers do not name their writer);
    its next put evicts one of them, so it stays at its quota."""
    with running_meta_service(member_max_objects=4, heartbeat_timeout_ms=10_000, lease_ttl_ms=500) as meta:   # no death
        other = StoreProcess(meta)
        store = DistributedObjectStore()
        assert store.setup(meta.local_config(heartbeat_interval_ms=200)) == 0
        assert store.init(0, True) == 0
        try:
            assert other("put", keys=["other"], layout=[64])["codes"] == [0]
            cid = store.get_local_service_id()
            values = {f"k{i}": bytes([65 + i]) * 512 for i in range(10)}
            for k, v in values.items():
                assert store.put(k, v) == 0, k
            assert store.batch_is_exist(list(values)) == [0] * 6 + [1] * 4
            assert store.get_batch(list(values)[6:]) == list(values.values())[6:]
            assert store.is_exist("other") == 1 and _kept(meta, cid) == (4, 4 * 512)

            meta.stop()
            meta.start()
            kept = list(values)[6:]
            wait_for(lambda: store.batch_is_exist(kept + ["other"]) == [1] * 5, 30,
                     "the members to re-join and report their objects")
            assert store.get_batch(kept) == [values[k] for k in kept]
            cid = store.get_local_service_id()
            assert _kept(meta, cid) == (4, 4 * 512)   # recovered: counted against the segment's member

            def stored() -> bool:   # once older leases would end, and the get's leases (one to evict) did
                code = store.put("after", b"a" * 1024)
                assert code in (0, errors.OUT_OF_MEMORY, errors.QUOTA_EXCEEDED), code
                return code == 0
            wait_for(stored, 10, "the re-joined segment to take new objects")
            assert _kept(meta, cid) == (4, 3 * 512 + 1024)
            assert store.batch_is_exist(kept + ["after", "other"]) == [0, 1, 1, 1, 1, 1]
        finally:
            store.close()
            other.stop()


def test_eviction_and_the_death_of_the_holding_segment_give_the_writers_quota_back():
    """Scenario: an insider (a member without a segment) writes into another member's segment. Far
    more than the segment holds goes through and is evicted under pressure: the count stays what the
    pool keeps of it; when the segment's owner dies, the objects leave the pool and so does the count."""
    with running_meta_service(member_max_objects=100, heartbeat_timeout_ms=1500) as meta:
        provider = StoreProcess(meta, dram_size="64MB")
        s = authed(addr_of(meta.meta_service_url))
        try:
            j = ask(s, p.Join(0, "insider", os.getpid()))
            assert isinstance(j, p.Joined), j
            cid, token = j.client_id, j.token
            keys: list[str] = []
            for i in range(30):   # 30 x 4 MiB through a 64 MB segment
                keys.append(f"ev{i}")
                assert _put_raw(s, cid, token, keys[-1:], 4 << 20) == [0], f"put {i} refused"
            held = ask(s, p.Exist(keys))
            assert isinstance(held, p.Flags)
            kept = _kept(meta, cid)
            assert kept is not None and kept[0] == sum(held.flags) and 0 < kept[0] < 16, (kept, held.flags)
            assert kept[1] == kept[0] * (4 << 20)

            provider.kill()

            def released() -> bool:
                assert isinstance(ask(s, p.Heartbeat(cid, token)), p.HeartbeatReply)   # the insider lives on
                return _kept(meta, cid) == (0, 0)
            wait_for(released, 20, "the dead segment's objects to leave the writer's count")
        finally:
            s.close()
            provider.stop()




def test_a_member_holds_at_most_its_quota_of_gva_leases():
    """Scenario: a lease of the GVA path pins an object against eviction; one member leases more keys
    than ``member_max_leases``: the ones past it get -3112 (nothing else changes), renewing a lease it
    holds still works, another member's quota is its own, and ending a lease gives one back."""
    with running_meta_service(member_max_leases=3) as meta:
        store = DistributedObjectStore()
        assert store.setup(meta.local_config()) == 0
        assert store.init(0, True) == 0
        s = authed(addr_of(meta.meta_service_url))
        try:
            keys = [f"l{i}" for i in range(5)]
            assert store.put_batch(keys, [bytes([i]) * 256 for i in range(5)]) == 0
            assert store.batch_add_lease(keys, 60_000) == [0, 0, 0, errors.QUOTA_EXCEEDED, errors.QUOTA_EXCEEDED]
            assert store.batch_add_lease(keys[:3], 60_000) == [0, 0, 0]   # renewals are not new leases
            j = ask(s, p.Join(0, "other", os.getpid()))
            assert isinstance(j, p.Joined), j
            other = ask(s, p.Lease(j.client_id, j.token, keys[2:], [0] * 3, 60_000))
            assert isinstance(other, p.Codes) and other.codes == [0, 0, 0], other
            assert store.batch_remove_lease(keys[:1]) == 0
            assert store.batch_add_lease(keys[3:], 60_000) == [0, errors.QUOTA_EXCEEDED]
            assert store.get_batch(keys) == [bytes([i]) * 256 for i in range(5)]
        finally:
            s.close()
            store.close()


def test_after_an_ha_failover_the_recovered_objects_count_against_their_holder():
    """Scenario: a member keeps its quota of 8 objects; the HA leader is killed. The new leader learns
    the objects back from the members' reports, counted against the member whose segment holds them;
    each new put past the quota evicts its least recently used object, so it keeps 8."""
    with tempfile.TemporaryDirectory(prefix="memcache-ha-") as d:
        pool = Pool(d, member_max_objects=8)
        try:
            leader = pool.leader()
            s = pool.store(pool.etcd_url)
            old = [f"old{i}" for i in range(8)]
            for k in old:
                assert s("put", keys=[k], layout=[1024])["codes"] == [0]
            assert _kept_of_pid(leader, s.proc.pid) == (8, 8 * 1024)
            leader.kill()
            new_leader = pool.leader(TTL_S + 8, [m for m in pool.metas if m is not leader])
            wait_for(lambda: s("get", keys=old, layout=[1024])["codes"] == [0] * 8, 30,
                     "the member to re-join the new leader with its objects")
            assert _kept_of_pid(new_leader, s.proc.pid) == (8, 8 * 1024)

            def put(key: str) -> bool:   # after the segment's grace, and the leases of the get above
                code = s("put", keys=[key], layout=[1024])["codes"][0]
                assert code == 0 or code in FAILOVER_CODES | {errors.QUOTA_EXCEEDED}, code
                return code == 0
            new = [f"new{i}" for i in range(9)]
            for k in new:
                wait_for(functools.partial(put, k), 15, f"the put of {k}")
            got = s("get", keys=old + new, layout=[1024])
            missing = [errors.OBJECT_NOT_EXISTS] * 9
            assert got["mismatches"] == [] and got["codes"] == missing + [0] * 8, got
            assert _kept_of_pid(new_leader, s.proc.pid) == (8, 8 * 1024)
        finally:
            pool.close()


def test_joining_again_and_again_is_bounded_by_max_members(caplog):
    """Scenario: each membership has its own quotas, so an insider could multiply them (and the
    MetaService's member table) by joining again and again. At most max_members are joined at once: a
    new member past it is refused with -3112 naming the setting, joined members go on, and a member
    that leaves makes room."""
    with running_meta_service(max_members=4) as meta:
        s = authed(addr_of(meta.meta_service_url))
        store = DistributedObjectStore()
        try:
            joined = [ask(s, p.Join(0, "insider", os.getpid())) for _ in range(4)]
            assert all(isinstance(j, p.Joined) for j in joined), joined
            fifth = ask(s, p.Join(0, "insider", os.getpid()))
            assert isinstance(fifth, p.Error) and fifth.code == errors.QUOTA_EXCEEDED and "max_members" in fifth.message
            assert store.setup(meta.local_config()) == 0
            assert store.init(0, True) == errors.QUOTA_EXCEEDED and "max_members" in caplog.text
            for j in joined:
                assert isinstance(j, p.Joined)
                assert isinstance(ask(s, p.Heartbeat(j.client_id, j.token)), p.HeartbeatReply)
            first = joined[0]
            assert isinstance(first, p.Joined) and isinstance(ask(s, p.Leave(first.client_id, first.token)), p.Ok)
            assert store.init(0, True) == 0 and store.put("k", b"v" * 64) == 0 and store.get("k") == b"v" * 64
        finally:
            s.close()
            store.close()


def _leased(meta: MetaServiceProcess, keys: list[str]) -> list[bool]:
    got = meta.http("/batch_query_keys?keys=" + ",".join(keys))["keys"]
    return [bool(k.get("leased")) for k in got]


def test_another_members_gva_lease_is_bounded_and_never_turns_the_owners_quota_into_refusals():
    """Scenario: an honest member keeps its quota of 4 objects (``member_max_objects``). An insider
    (a pure client holding the secret) leases all four on the GVA path for 24 h. Before, the owner's
    every further put failed with -3112 for the lease's life (none of its objects could be evicted to
    make room) and the objects stayed pinned for a day. Now the leased objects count against the
    leaser: the owner's next put succeeds and the leased ones stay readable; and the lease lasts
    ``gva_lease_max_ms`` (3 s here), not 24 h: the objects are evictable again within it."""
    with running_meta_service(member_max_objects=4, lease_ttl_ms=1000, gva_lease_max_ms=3000) as meta:
        owner = DistributedObjectStore()
        assert owner.setup(meta.local_config()) == 0
        assert owner.init(0, True) == 0
        s = authed(addr_of(meta.meta_service_url))
        try:
            values = {f"o{i}": bytes([i + 1]) * 1024 for i in range(4)}
            assert owner.put_batch(list(values), list(values.values())) == 0
            j = ask(s, p.Join(0, "insider", os.getpid()))
            assert isinstance(j, p.Joined), j
            lease = ask(s, p.Lease(j.client_id, j.token, list(values), [0] * 4, 86_400_000))
            assert isinstance(lease, p.Codes) and lease.codes == [0] * 4, lease
            assert _leased(meta, list(values)) == [True] * 4
            assert owner.put("o4", b"\x05" * 1024) == 0, "another member's lease refused the owner's put"
            assert owner.get_batch(list(values)) == list(values.values()), "a leased object was evicted"
            wait_for(lambda: _leased(meta, list(values)) == [False] * 4, 20,
                     "the insider's 24 h lease to end at gva_lease_max_ms")
        finally:
            s.close()
            owner.close()
