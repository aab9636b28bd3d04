"""Validated peers: what an authenticated but hostile (or buggy) member says is checked, and members
act only on what is theirs."""

from __future__ import annotations

import os
import secrets
import time
from functools import partial

import pytest

from memcache_core import DistributedObjectStore, ReplicateConfig, errors
from memcache_core import protocol as p
from memcache_core.host import env_host_id, shm_dir
from memcache_core.rpc import expect
from memcache_core.testing import wait_for
from tests.security.wire import LAYOUT, addr_of, ask, authed, rpc

pytestmark = pytest.mark.integration


def _segment(path: str, size: int = 8 << 20, host_id: str | None = None) -> p.SegmentInfo:
    return p.SegmentInfo(0, size, host_id or env_host_id(), path, "127.0.0.1:9")


def test_forged_join_naming_an_arbitrary_file_is_refused(meta, tmp_path):
    """Scenario: a member joins announcing ``shm_path`` = an unrelated file on the host (and a path in
    the shm directory that is not a segment name). Validation refuses both: an error reply, no
    segment in the pool, the file unchanged, the server alive."""
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 100_000)
    os.chmod(victim, 0o644)
    c = rpc(meta)
    try:
        for path in (str(victim), os.path.join(shm_dir(), "not-a-segment"), "/etc/passwd",
                     os.path.join(shm_dir(), "memcache-1-ab/../../etc/passwd")):
            with pytest.raises(errors.InvalidParameter):
                c.call(p.Join(0, env_host_id(), os.getpid(), _segment(path)), probe=True)
        assert expect(c.call(p.GetSegments([]), idempotent=True), p.Segments).segments == []
    finally:
        c.close()
    assert victim.read_bytes() == b"precious" * 100_000
    assert meta.healthy()


def test_symlinked_segment_file_is_never_mapped_by_peers(meta, stores, tmp_path):
    """Scenario: a member announces a well-named segment file in the shm directory that is a symlink
    to a victim file. An honest put placed there (``preferredLocalServiceIDs``) fails, the victim file
    is unchanged, and the honest data elsewhere is intact."""
    victim = tmp_path / "victim.bin"
    original = bytes(range(256)) * (32 << 12)          # 8 MiB
    victim.write_bytes(original)
    link = os.path.join(shm_dir(), f"memcache-{os.getpid()}-{secrets.token_hex(8)}")
    os.symlink(victim, link)
    honest = DistributedObjectStore()
    try:
        assert honest.setup(meta.local_config(heartbeat_interval_ms=200, dram_size="16MB")) == 0 and honest.init(0, True) == 0
        host_id = meta.http(f"/query_segment?segment={honest.get_local_service_id()}")["host_id"]
        s = authed(addr_of(meta.meta_service_url))
        joined = expect(ask(s, p.Join(0, host_id, os.getpid(), _segment(link, len(original), host_id))), p.Joined)
        payload = b"\x5a" * (1 << 20)
        rc = honest.put("into-the-link", payload, ReplicateConfig(replicaNum=1,
                                                                  preferredLocalServiceIDs=[joined.client_id]))
        assert rc != 0
        assert victim.read_bytes() == original
        assert honest.put("honest", payload) == 0 and honest.get("honest") == payload
        assert honest.get("into-the-link") == b""
        s.close()
    finally:
        honest.close()
        os.unlink(link)


def test_a_generation_of_2_64_minus_1_is_an_error_reply_and_the_server_lives(meta, stores):
    """Scenario: a Join reporting an object of generation 2**64-1, then an Alloc, then a Commit with that
    generation. Before, the Alloc's reply could not be encoded and the MetaService exited. Now each is
    an error reply (or a normal answer) and the pool keeps serving."""
    honest = stores()
    assert honest("put", keys=["before"], layout=LAYOUT)["codes"] == [0]
    path = os.path.join(shm_dir(), f"memcache-{os.getpid()}-{secrets.token_hex(8)}")
    s = authed(addr_of(meta.meta_service_url))
    try:
        bad = p.Join(0, "h", os.getpid(), _segment(path), [p.ObjectReport("x", 0, 4096, 2**64 - 1)])
        r = ask(s, bad)
        assert isinstance(r, p.Error) and r.code == errors.INVALID_PARAM
        j = expect(ask(s, p.Join(0, "h", os.getpid(), None)), p.Joined)
        a = expect(ask(s, p.Alloc(j.client_id, j.token, ["k"], [4096])), p.AllocReply)
        assert a.results[0].code == 0
        r = ask(s, p.Commit(j.client_id, j.token, ["k"], [2**64 - 1]))
        assert isinstance(r, p.Error) and r.code == errors.INVALID_PARAM
        r = ask(s, p.Alloc(j.client_id, j.token, ["k2"], [2**64 - 1]))
        assert isinstance(r, p.Error)
    finally:
        s.close()
    assert meta.healthy()
    got = honest("get", keys=["before"], layout=LAYOUT)
    assert got["codes"] == [0] and got["mismatches"] == []
    assert honest("put", keys=["after"], layout=LAYOUT)["codes"] == [0]


def test_a_join_reusing_a_live_member_id_gets_a_fresh_one(meta, stores):
    """Scenario: a forger joins proposing a live member's id (and its own segment), then leaves. The
    forger gets a fresh id; the victim keeps heartbeating (it outlives two heartbeat timeouts) and its
    objects; removing them never drives a segment's ``used`` below zero."""
    victim = stores()
    vid = victim("id")["id"]
    before = member_events(meta)
    keys = [f"v-{i}" for i in range(6)]
    assert victim("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 6
    path = os.path.join(shm_dir(), f"memcache-{os.getpid()}-{secrets.token_hex(8)}")
    s = authed(addr_of(meta.meta_service_url))
    try:
        j = expect(ask(s, p.Join(vid, "forger", os.getpid(), _segment(path))), p.Joined)
        assert j.client_id != vid
        j2 = expect(ask(s, p.Join(vid, "forger", os.getpid(), None, [], b"\0" * 16)), p.Joined)
        assert j2.client_id != vid
        assert isinstance(ask(s, p.Leave(j.client_id, j.token)), p.Ok)
        assert isinstance(ask(s, p.Leave(j2.client_id, j2.token)), p.Ok)
    finally:
        s.close()
    for _ in range(2):   # two of the victim's heartbeats accepted after the forger left
        wait_for(partial(heard_since, meta, vid, time.monotonic()), 10, "a heartbeat of the victim")
    # its heartbeats never failed: it was not dropped and did not re-join (the forger joined and left twice)
    assert member_events(meta) == {**before, "joins": before["joins"] + 2, "leaves": before["leaves"] + 2}
    segs = meta.http("/get_all_segments")["segments"]
    assert [x["segment_id"] for x in segs] == [vid]
    got = victim("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 6 and got["mismatches"] == []
    assert victim("remove", keys=keys)["codes"] == [0] * 6
    assert victim("remove", keys=keys)["codes"] != [0] * 6     # a second remove frees nothing twice
    for seg in meta.http("/get_all_segments")["segments"]:
        assert seg["used_bytes"] >= 0
    # the removed objects were leased by the get: their space comes back when the leases end
    wait_for(lambda: meta.http("/api/v1/capacity/usage")["used_bytes"] == 0, 10, "space freed once")
    assert victim("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 6


def test_leave_commit_abort_as_another_member_without_its_token_are_refused(meta, stores):
    """Scenario: a peer sends Leave, Commit, Abort and OwnerGone carrying a live member's id but not its token
    (empty, or a guess). Each is refused; the victim's pending put commits normally afterwards and
    its committed objects stay, byte-exact; the victim stays a member."""
    victim = DistributedObjectStore()
    assert victim.setup(meta.local_config(heartbeat_interval_ms=200, dram_size="16MB")) == 0 and victim.init(0, True) == 0
    try:
        svc = victim._service()
        cid = svc.client_id
        assert victim.put("committed", b"c" * 50_000) == 0
        a = expect(svc.rpc.call(p.Alloc(cid, svc.session.token, ["pending"], [4096])), p.AllocReply).results[0]
        assert a.code == 0
        s = authed(addr_of(meta.meta_service_url))
        for token in (b"", b"\0" * 16, secrets.token_bytes(16)):
            for req in (p.Commit(cid, token, ["pending"], [a.generation]),
                        p.Abort(cid, token, ["pending"], [a.generation]),
                        p.Leave(cid, token), p.Heartbeat(cid, token), p.OwnerGone(cid, token, cid, ""),
                        p.Alloc(cid, token, ["x"], [10]), p.Corrupt(cid, token, ["committed"], [1])):
                r = ask(s, req)
                if isinstance(req, p.Heartbeat):
                    assert isinstance(r, p.HeartbeatReply) and not r.known and not r.journal
                else:
                    assert isinstance(r, p.Error) and r.code == errors.CLIENT_NOT_INITIALIZED, (req, r)
        s.close()
        assert victim.is_exist("pending") == 0
        codes = expect(svc.rpc.call(p.Commit(cid, svc.session.token, ["pending"], [a.generation])), p.Codes)
        assert codes.codes == [0]
        assert svc.client_id == cid and victim.get("committed") == b"c" * 50_000
        wait_for(lambda: victim.is_exist("pending") == 1, 5, "the victim's own commit")
        assert [x["segment_id"] for x in meta.http("/get_all_segments")["segments"]] == [cid]
    finally:
        victim.close()


def test_config_store_value_over_the_limit_is_refused(meta):
    """Scenario: a peer stores a value over ``config_store_max_value_bytes`` (1 MiB by default) on the
    config-store port. Refused with an error reply; nothing stored; small values still work."""
    s = authed(addr_of(meta.config_store_url))
    try:
        r = ask(s, p.ConfigPut("big", b"x" * ((1 << 20) + 1)))
        assert isinstance(r, p.Error) and r.code == errors.INVALID_PARAM
        assert ask(s, p.ConfigGet("big")) == p.Value(None)
        r = ask(s, p.ConfigPut("k" * 5000, b"v"))
        assert isinstance(r, p.Error)
        assert isinstance(ask(s, p.ConfigPut("small", b"v" * 100)), p.Ok)
        assert ask(s, p.ConfigGet("small")) == p.Value(b"v" * 100)
    finally:
        s.close()


def member_events(meta) -> dict[str, float]:
    """joins, leaves, deaths and re-joins counted by the MetaService (``member_events_total``)."""
    out = dict.fromkeys(("joins", "leaves", "deaths", "rejoins"), 0.0)
    for line in meta.http("/metrics").splitlines():
        for e in out:
            if line.startswith(f'memcache_member_events_total{{event="{e}"}} '):
                out[e] = float(line.split()[1])
    return out


def heard_since(meta, client_id: int, t: float) -> bool:
    """Has the MetaService heard from this member since ``t`` (this process's monotonic clock)? The
    age it reports was taken after ``asked``, so ``asked - age`` is no later than its last heartbeat."""
    asked = time.monotonic()
    ages = [m["last_seen_s"] for m in meta.http("/api/v1/stats")["members"] if m["client_id"] == client_id]
    return bool(ages) and asked - ages[0] > t
