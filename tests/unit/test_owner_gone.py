"""A dead owner of a same-host segment, proven by that host's kernel: the owner lock
(``memory.hold_owner_lock`` / ``owner_alive``) with real processes and files, and what the MetaService
does with a member's ``OwnerGone`` report (``meta.server.answer``, real frames' bodies)."""

from __future__ import annotations

import os
import subprocess
import sys

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.config import MetaConfig
from memcache_core.host import shm_dir
from memcache_core.memory import Mapping, owner_alive
from memcache_core.meta import server, service
from memcache_core.testing import die_with_parent

OWNER = ("import sys, time\nfrom memcache_core.memory import Mapping\n"
         "m = Mapping(sys.argv[1], 1 << 16, create=True)\nprint('ready', flush=True)\ntime.sleep(120)\n")


def test_owner_lock_tells_a_live_owner_from_a_killed_one():
    """Scenario: a process creates a segment file and is killed with kill -9. While it lives every
    prober (several at once, one of them also mapping the file, another opening and closing it) sees it
    alive; once it is dead every prober sees it dead, and a file that no longer exists has no owner."""
    path = os.path.join(shm_dir(), f"memcache-{os.getpid()}-{os.urandom(8).hex()}")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, path], stdout=subprocess.PIPE, text=True,
                             preexec_fn=die_with_parent())
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        peer = Mapping(path, 1 << 16, create=False)
        os.close(os.open(path, os.O_RDONLY))
        assert [owner_alive(path) for _ in range(3)] == [True] * 3
        owner.kill()
        owner.wait()
        assert [owner_alive(path) for _ in range(3)] == [False] * 3   # the file (and our mapping) outlive it
        peer.close()
    finally:
        owner.kill()
        owner.wait()
        if os.path.exists(path):
            os.unlink(path)
    assert owner_alive(path) is False


def _call(core: service.MetaServiceCore, req: p.Request) -> p.Reply:
    return p.reply_decoder.decode(server.answer(core, p.request_encoder.encode(req)))


def _join(core: service.MetaServiceCore, host: str) -> tuple[p.Joined, p.SegmentInfo]:
    seg = p.SegmentInfo(0, 1 << 24, host, f"/memcache-{os.getpid()}-{os.urandom(8).hex()}", "127.0.0.1:9")
    joined = _call(core, p.Join(0, host, os.getpid(), seg))
    assert isinstance(joined, p.Joined), joined
    return joined, seg


def _put(core: service.MetaServiceCore, j: p.Joined, key: str) -> None:
    a = _call(core, p.Alloc(j.client_id, j.token, [key], [4096], 1, [j.client_id]))
    assert isinstance(a, p.AllocReply) and a.results[0].code == 0
    assert _call(core, p.Commit(j.client_id, j.token, [key], [a.results[0].generation])) == p.Codes([0])


def test_owner_gone_drops_the_member_only_on_a_report_from_its_host_about_its_file():
    """Scenario: the owner of segment D holds a committed object. Reports that D's owner is dead are
    ignored from a member of another host, naming another file, from D's owner itself, or without a
    reporter's token; D stays a member and its object stays. A member of D's host naming D's file
    drops it at once: D's object is a miss, and D's next heartbeat finds it is no longer a member."""
    core = service.MetaServiceCore(MetaConfig(meta_service_url="tcp://127.0.0.1:1",
                                              config_store_url="tcp://127.0.0.1:2", metrics_url="http://127.0.0.1:3"))
    dead, seg = _join(core, "host-a")
    near, _ = _join(core, "host-a")
    far, _ = _join(core, "host-b")
    _put(core, dead, "k")
    for reporter, path in ((far, seg.shm_path), (near, seg.shm_path + "0"), (dead, seg.shm_path)):
        assert isinstance(_call(core, p.OwnerGone(reporter.client_id, reporter.token, dead.client_id, path)), p.Ok)
    refused = _call(core, p.OwnerGone(near.client_id, b"\0" * 16, dead.client_id, seg.shm_path))
    assert isinstance(refused, p.Error) and refused.code == errors.CLIENT_NOT_INITIALIZED
    assert dead.client_id in core.members and _call(core, p.Exist(["k"])) == p.Flags([True])
    assert isinstance(_call(core, p.OwnerGone(near.client_id, near.token, dead.client_id, seg.shm_path)), p.Ok)
    assert dead.client_id not in core.members and dead.client_id not in core.table.segments
    assert _call(core, p.Exist(["k"])) == p.Flags([False])
    assert core.member_events["deaths"] == 1
    beat = _call(core, p.Heartbeat(dead.client_id, dead.token))
    assert isinstance(beat, p.HeartbeatReply) and not beat.known
