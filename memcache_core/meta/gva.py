"""The MetaService's side of the GVA path (memcache_hybrid's ``batch_alloc`` / ``batch_copy`` /
``batch_write_finish`` / ``batch_add_lease``): what a caller may copy where, decided on the table's state.

A GVA names a byte of an object's replica (``local/gva.py`` defines the address); the caller resolves
it to (key, generation, segment, payload range) and asks here before each copy (``Grant``):
* a write needs an object allocated by the caller, not finished yet, of that generation, with a
  replica in that segment, the range inside its payload, and at least half the pending timeout left
  before its deadline (the rule of ``put``: the space of a writer past its deadline is reclaimed);
* a read needs a committed object of that generation, the range inside its payload, and a lease the
  caller holds on it (``Lease``, ``batch_add_lease``).
Anything else is a per-range code, and the caller copies nothing for that range: a stale GVA (an
object removed, replaced, reclaimed, or from before a MetaService restart, whose table has no pending
objects and no leases) or a forged one never reaches another object's bytes.

Leases of the GVA path are held per caller (``ObjectTable.held``: key -> caller -> (generation, end);
``ObjectTable.leases_of`` counts each caller's, bounded by ``member_max_leases``);
each one also extends the object's ``lease_until``, which keeps eviction and space reuse away exactly
as a get's lease does. Removing a lease ends the caller's right to copy out; the object stays pinned
until the end it was leased to (another reader's lease may still count on it). A lease lasts at most
``gva_lease_max_ms`` (at least ``lease_ttl_ms``): a reader holds an object longer only by leasing it
again, as a reader of gets does by reading. While a member holds a lease on another's object, the
object counts against the leaser, not in its writer's quota (``kept.py``: ``ObjectTable.relend``).
"""

from __future__ import annotations

from .. import errors
from .. import protocol as p
from .table import ObjectTable


def info(t: ObjectTable, cid: int, keys: list[str]) -> p.InfoReply:
    """Committed objects, and the caller's own unfinished ones (flagged ``pending``); no lease."""
    results: list[p.Found | None] = []
    pending: list[bool] = []
    fences: list[list[int]] = []   # a pending object's places: their segments' join tokens (fence.py)
    for k in keys:
        obj = t.objects.get(k)
        mine = obj is not None and not obj.committed and obj.owner == cid
        f = obj.found() if obj is not None and (obj.committed or mine) else None
        results.append(f)
        pending.append(mine)
        fences.append([t.segments[loc.segment_id].fence if loc.segment_id in t.segments else 0
                       for loc in f.locations] if mine and f is not None else [])
    return p.InfoReply(results, pending, fences)


def add_lease(t: ObjectTable, cid: int, keys: list[str], generations: list[int], ttl_s: float,
              now: float, max_leases: int = 0) -> list[int]:
    """Lease committed objects to the caller until ``now + ttl_s`` (a generation of 0: the current one).
    A caller holding ``max_leases`` (0: no bound) gets no new one: QUOTA_EXCEEDED for that key."""
    codes = []
    end = now + ttl_s
    for k, g in zip(keys, generations, strict=True):
        obj = t.objects.get(k)
        if obj is None or not obj.committed:
            codes.append(errors.OBJECT_NOT_EXISTS)
        elif g and obj.generation != g:
            codes.append(errors.STATE_MISMATCH)
        elif max_leases and t.leases_of.get(cid, 0) >= max_leases and cid not in t.held.get(obj.key, {}):
            codes.append(errors.QUOTA_EXCEEDED)
        else:
            t.lease(obj, end)
            mine = t.held.setdefault(obj.key, {})
            gen_end = mine.get(cid)
            if gen_end is None:
                t.leases_of[cid] = t.leases_of.get(cid, 0) + 1
            mine[cid] = (obj.generation, max(end, gen_end[1]) if gen_end and gen_end[0] == obj.generation else end)
            t.relend(obj.key)
            codes.append(errors.SUCCESS)
    return codes


def remove_lease(t: ObjectTable, cid: int, keys: list[str]) -> list[int]:
    """End the caller's leases: 0 where it held one, OBJECT_NOT_EXISTS where it held none."""
    codes = []
    for k in keys:
        mine = t.held.get(k)
        if mine is None or mine.pop(cid, None) is None:
            codes.append(errors.OBJECT_NOT_EXISTS)
            continue
        _released(t, cid)
        if not mine:
            del t.held[k]
        t.relend(k)
        codes.append(errors.SUCCESS)
    return codes


def grant(t: ObjectTable, cid: int, req: p.Grant, now: float) -> p.Granted:
    codes, left = [], []
    for k, g, sid, lo, hi in zip(req.keys, req.generations, req.segments, req.starts, req.ends, strict=True):
        code, until = _grant_one(t, cid, k, g, sid, lo, hi, req.write, now)
        codes.append(code)
        left.append(max(0, int((until - now) * 1000)) if code == errors.SUCCESS else 0)
    return p.Granted(codes, left)


def _grant_one(t: ObjectTable, cid: int, key: str, generation: int, segment_id: int, lo: int, hi: int,
               write: bool, now: float) -> tuple[int, float]:
    obj = t.objects.get(key)
    if obj is None:
        return errors.OBJECT_NOT_EXISTS, 0.0
    if obj.generation != generation or all(loc.segment_id != segment_id for loc in obj.locations):
        return errors.STATE_MISMATCH, 0.0     # replaced, moved, or a GVA that never named this object
    if not 0 <= lo < hi <= obj.size:
        return errors.INVALID_PARAM, 0.0
    if write:
        seg = t.segments.get(segment_id)
        if obj.committed or obj.owner != cid or seg is None or seg.held:   # (held: segment.takes_new)
            return errors.STATE_MISMATCH, 0.0  # finished, or someone else's
        if obj.pending_deadline - now < t.pending_timeout_s / 2:
            return errors.TIMEOUT, 0.0         # too late to start: the space may be reclaimed while we copy
        return errors.SUCCESS, obj.pending_deadline
    if not obj.committed:
        return errors.STATE_MISMATCH, 0.0      # not finished: nothing readable yet
    held = t.held.get(obj.key, {}).get(cid)
    if held is None or held[0] != generation or held[1] <= now:
        return errors.STATE_MISMATCH, 0.0      # no lease of the caller's (expired, removed, never taken)
    return errors.SUCCESS, held[1]


def expire(t: ObjectTable, now: float) -> None:
    """Forget leases that ended or whose object is gone or replaced (housekeeping)."""
    for k in [k for k, mine in t.held.items() if _prune(t, k, mine, now)]:
        del t.held[k]
        t.relend(k)


def _prune(t: ObjectTable, key: str, mine: dict[int, tuple[int, float]], now: float) -> bool:
    obj = t.objects.get(key)
    ended = [c for c, (g, end) in mine.items() if end <= now or obj is None or not obj.committed or obj.generation != g]
    for cid in ended:
        del mine[cid]
        _released(t, cid)
    if ended and mine:
        t.relend(key)
    return not mine


def _released(t: ObjectTable, cid: int) -> None:
    """One lease of the caller's ended (``ObjectTable.leases_of``)."""
    n = t.leases_of.get(cid, 0) - 1
    if n > 0:
        t.leases_of[cid] = n
    else:
        t.leases_of.pop(cid, None)
