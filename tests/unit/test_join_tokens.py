"""The MetaService's side of the write fence's join tokens (``memcache_core/fence.py``, docs/design.md
"Failure of the MetaService"): every Join of a segment gets a fresh token, and every grant of space
in it carries the token of the join it was made in (``meta.server.answer``, real frames' bodies)."""

from __future__ import annotations

import os

from memcache_core import protocol as p
from memcache_core.config import MetaConfig
from memcache_core.meta import server, service


def _call(core: service.MetaServiceCore, req: p.Request) -> p.Reply:
    return p.reply_decoder.decode(server.answer(core, p.request_encoder.encode(req)))


def _core() -> service.MetaServiceCore:
    return service.MetaServiceCore(MetaConfig(meta_service_url="tcp://127.0.0.1:1",
                                              config_store_url="tcp://127.0.0.1:2", metrics_url="http://127.0.0.1:3"))


def _join(core: service.MetaServiceCore, cid: int = 0, fences: bool = True) -> p.Joined:
    seg = p.SegmentInfo(0, 1 << 24, "host-a", f"/memcache-{os.getpid()}-{os.urandom(8).hex()}", "127.0.0.1:9")
    joined = _call(core, p.Join(cid, "host-a", os.getpid(), seg, fences=fences))
    assert isinstance(joined, p.Joined), joined
    return joined


def _alloc(core: service.MetaServiceCore, w: p.Joined, key: str, at: int) -> p.AllocResult:
    a = _call(core, p.Alloc(w.client_id, w.token, [key], [4096], 1, [at]))
    assert isinstance(a, p.AllocReply) and a.results[0].code == 0, a
    return a.results[0]


def test_a_rejoin_of_the_same_meta_service_gets_a_new_token_and_grants_carry_it():
    """Scenario: provider P joins; writer W is granted space in P (the grant carries P's token, and
    so does ``batch_get_key_info``'s description of W's pending object). P is declared dead and
    re-joins the same MetaService with its id: the epoch is the same, the token is not, and W's next
    grant in P carries the new one."""
    core = _core()
    first = _join(core)
    assert first.fence != 0 and first.fence != first.meta_epoch
    w = _join(core)
    res = _alloc(core, w, "old", first.client_id)
    assert [loc.segment_id for loc in res.locations] == [first.client_id] and res.fences == [first.fence]
    info = _call(core, p.Info(w.client_id, w.token, ["old"]))
    assert isinstance(info, p.InfoReply) and info.pending == [True] and info.fences == [[first.fence]]
    core._drop_member(first.client_id, "missed heartbeats for 1.5s, declared dead")
    again = _join(core, first.client_id)
    assert again.client_id == first.client_id and again.meta_epoch == first.meta_epoch
    assert again.fence not in (0, first.fence)
    assert _alloc(core, w, "new", first.client_id).fences == [again.fence]
    assert _call(core, p.Info(w.client_id, w.token, ["old"])) == p.InfoReply([None], [False], [[]])


def test_an_owner_of_an_older_build_fences_by_the_epoch():
    """Scenario: a provider whose Join does not ask for tokens (an older build, which sets its fence to
    the MetaService's epoch): its join's token is the epoch, so writers carry the value its fence holds."""
    core = _core()
    old = _join(core, fences=False)
    assert old.fence == old.meta_epoch
    w = _join(core)
    assert _alloc(core, w, "k", old.client_id).fences == [old.meta_epoch]
