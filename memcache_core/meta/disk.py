"""The MetaService's side of the disk tiers: which objects have a disk record, and where.

A provider with a disk tier syncs with the MetaService (``DiskSync``, a few times a second): it
reports the records it wrote and dropped, and gets back the objects of its segment to copy to disk
(``offload``) and the records of objects that left the pool (``drop``). The table keeps one disk
location per object (``Obj.disk``: the provider's segment id and the record's generation).

* **Which objects are offloaded**: ``write_through``, every committed object of the segment;
  ``on_evict``, the least recently used objects, which the next evictions would take: walking the
  segment's LRU list from its head, the first ``used - low * size / 2`` bytes (so copies start when
  the segment passes 40% with the default 90/80 marks, well ahead of the eviction at 90%: a burst of
  puts has half the segment to fill before eviction would take an object not yet on disk).
  Never more bytes per sync than the provider's writer queue takes (``room``); an object offered is
  not offered again for ``OFFER_RETRY_S``.
* **Eviction** (``ObjectTable._evict_one``) of an object with a disk record drops its DRAM copies
  only; it stays visible (exist, lookup) with its disk location, and a read is served by the provider.
* **Promotion** (``Promote`` / ``Promoted``): the provider asks for space in its own segment, copies
  the record into it (header last) and reports; the object then has that DRAM location again.
* Reports are checked like DRAM ones: a record is attached only to the committed object of the same
  key, size and checksum; anything else is sent back to be deleted. An object has one disk location:
  a record reported for an object another provider holds a record of replaces it (a provider killed
  and restarted on its disk_path re-joins before its old self is declared dead), and the other
  provider is told to delete its copy. Objects written without a checksum (``checksum: false``) are
  never copied: the writer could not tell their bytes from space reused after an eviction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .. import errors
from .. import protocol as p
from ..layout import footprint
from .objects import new_obj
from .table import Obj, ObjectTable

OFFER_RETRY_S = 30.0
OFFLOAD_MARK = 0.25        # on_evict: copies start above this fraction of the low-water mark
MAX_SCAN = 8192            # objects of the LRU list looked at per sync
MAX_DROPS = 1 << 20        # records waiting to be deleted, per provider


@dataclasses.dataclass
class DiskTier:
    policy: str = "on_evict"
    capacity: int = 0
    used: int = 0
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    scanned: tuple[int, ...] | None = None   # the segment's state at the last offload scan


def attach(t: ObjectTable, sid: int, r: p.ObjectReport, create: bool, now: float = 0.0) -> bool:
    """Record that segment ``sid``'s provider holds a disk record ``r``. ``create``: the object may be
    unknown (a provider's records after a MetaService or provider restart). A record is a copy of one
    write: it attaches only to the object of its generation. With ``create``, a record newer than the
    table's object replaces that object (the key was written again after it: the newest write wins,
    as for DRAM reports in ``ObjectTable.add_segment``); an older one is refused."""
    cur = t.objects.get(r.key)
    if create and cur is not None and cur.committed and r.generation > cur.generation:
        t.drop(cur, now)
        cur = None
    if cur is None and create:
        t.objects[r.key] = new_obj(r.key, r.size, r.generation, [], r.checksum, disk=(sid, r.generation))
        t.bump_generation(r.generation)
        return True
    if (cur is None or not cur.committed or cur.generation != r.generation or cur.size != r.size
            or not cur.checksum or cur.checksum != r.checksum):
        return False
    if cur.disk is not None and cur.disk[0] != sid:
        # the newest report wins: the other may be a provider killed and restarted on the same disk_path
        # before its old self was declared dead (whose records these are now); else a duplicate copy
        t.disk_drops.setdefault(cur.disk[0], []).append(p.ObjectReport(r.key, 0, cur.size, cur.disk[1],
                                                                       cur.checksum))
    cur.disk = (sid, r.generation)
    return True


def add_reports(t: ObjectTable, sid: int, reports: list[p.ObjectReport], now: float = 0.0) -> int:
    """A joining provider's disk records; those that mean another object, and those of objects removed
    whose deletion no owner confirmed (a provider restarted on the disk_path of one that did not hear
    of the removal: ``ObjectTable.removed_records``), are sent back to be deleted."""
    removed = t.removed_records()
    refused = [r for r in reports if (r.key, r.generation) in removed or not attach(t, sid, r, create=True, now=now)]
    if refused:
        t.disk_drops.setdefault(sid, []).extend(refused)
    t.disk_tiers.setdefault(sid, DiskTier())
    return len(reports) - len(refused)


def detach(t: ObjectTable, sid: int, r: p.ObjectReport, now: float) -> None:
    """The provider dropped this record (its tier was full, or the record failed its checksum)."""
    cur = t.objects.get(r.key)
    if cur is None or cur.disk != (sid, r.generation):
        return
    cur.disk = None
    if not cur.locations:
        t.counters.disk_drops += 1
        t.drop(cur, now)


def sync(t: ObjectTable, sid: int, req: p.DiskSync, now: float) -> p.DiskWork:
    tier = t.disk_tiers.setdefault(sid, DiskTier())
    tier.policy, tier.capacity, tier.used, tier.counters = req.policy, req.capacity, req.used, dict(req.counters)
    refused = [r for r in req.added if not attach(t, sid, r, create=False)]
    for r in req.dropped:
        detach(t, sid, r, now)
    drop = t.disk_drops.pop(sid, []) + refused
    return p.DiskWork(offload=_offload(t, sid, tier, req.room, now), drop=drop, promote=t.disk_wanted.pop(sid, []))


def _offload(t: ObjectTable, sid: int, tier: DiskTier, room: int, now: float) -> list[p.ObjectReport]:
    """Objects of segment ``sid`` to copy: the eviction window from the LRU head (both policies), and
    with ``write_through`` the most recently used first from the tail (where new commits land). A sync
    that finds the segment as the last one left it scans nothing."""
    seg = t.segments.get(sid)
    if seg is None or room <= 0:
        return []
    a = seg.allocator
    sig = (t.counters.commits, t.counters.evictions, a.used, len(seg.lru), int(now // OFFER_RETRY_S))
    if sig == tier.scanned:
        return []
    out: list[p.ObjectReport] = []
    room = _walk(seg.lru.values(), a.used - OFFLOAD_MARK * t.low * a.size, sid, room, now, out)
    if tier.policy == "write_through":
        room = _walk(seg.lru.values(reverse=True), float("inf"), sid, room, now, out)
    tier.scanned = sig if room > 0 else None   # cut short by the writer's room: look again next time
    return out


def _walk(objs: Iterable[Obj], window: float, sid: int, room: int, now: float,
          out: list[p.ObjectReport]) -> int:
    """Offer objects without a disk record until ``window`` bytes were walked, ``MAX_SCAN`` objects
    were looked at, or ``room`` is spent; returns the room left (0 when it ran out)."""
    walked = 0
    for n, obj in enumerate(objs):
        if (walked >= window and obj.disk_offered >= 0) or n >= MAX_SCAN:   # < 0: asked for (demote)
            break
        walked += footprint(obj.size)
        if obj.disk is not None or obj.disk_offered > now or not obj.checksum:
            continue   # without a committed checksum a copy could not be told from reused space
        if obj.size > room:
            return 0
        offset = next((loc.offset for loc in obj.locations if loc.segment_id == sid), None)
        if offset is None:
            continue
        room -= obj.size
        obj.disk_offered = now + OFFER_RETRY_S
        out.append(p.ObjectReport(obj.key, offset, obj.size, obj.generation, obj.checksum))
    return room


def promote(t: ObjectTable, sid: int, keys: list[str], now: float) -> list[p.AllocResult]:
    """Space in the provider's own segment for disk-only objects it holds records of."""
    seg = t.segments.get(sid)
    out = []
    for k in keys:
        obj = t.objects.get(k)
        if obj is None or not obj.committed or obj.disk is None or obj.disk[0] != sid:
            out.append(p.AllocResult(errors.OBJECT_NOT_EXISTS))
        elif obj.locations or (k, sid) in t.promoting:
            out.append(p.AllocResult(errors.OBJECT_ALREADY_EXISTS))   # in DRAM already, or on its way
        elif seg is None or not seg.takes_new(now):
            out.append(p.AllocResult(errors.OUT_OF_MEMORY))
        else:
            off = t.alloc_in(seg, footprint(obj.size), now)
            if off is None:
                out.append(p.AllocResult(errors.OUT_OF_MEMORY))
                continue
            t.promoting[(k, sid)] = (obj.generation, off, now + t.pending_timeout_s, obj.size)
            out.append(p.AllocResult(errors.SUCCESS, obj.generation, [p.Location(sid, off)], [seg.fence]))
    return out


def promoted(t: ObjectTable, sid: int, req: p.Promoted, now: float) -> list[int]:
    """The provider copied (or failed to copy) records into the space ``promote`` gave it."""
    codes = []
    for k, off, ok in zip(req.keys, req.offsets, req.ok, strict=True):
        held = t.promoting.get((k, sid))
        if held is None or held[1] != off:
            codes.append(errors.STATE_MISMATCH)
            continue
        del t.promoting[(k, sid)]
        obj, seg = t.objects.get(k), t.segments.get(sid)
        if seg is None:
            codes.append(errors.STATE_MISMATCH)
            continue
        if not ok or obj is None or not obj.committed or obj.generation != held[0] or obj.locations:
            seg.allocator.free_range(off, footprint(held[3]))
            codes.append(errors.STATE_MISMATCH)
            continue
        obj.locations = [*obj.locations, p.Location(sid, off)]
        seg.lru[obj.key] = obj   # the object's own string: k is the request's copy
        t.counters.promotions += 1
        codes.append(errors.SUCCESS)
    return codes


def housekeeping(t: ObjectTable, now: float) -> None:
    """Give back the space of promotions nobody reported within the pending timeout; bound the records
    waiting to be deleted by a provider that does not sync (the oldest are forgotten: those files
    stay until its tier's LRU drops them)."""
    for drops in t.disk_drops.values():
        if len(drops) > MAX_DROPS:
            del drops[:len(drops) - MAX_DROPS]
    for (k, sid), (_gen, off, deadline, size) in list(t.promoting.items()):
        if deadline <= now:
            del t.promoting[(k, sid)]
            seg = t.segments.get(sid)
            if seg is not None:   # the owner's copy may still run: out of use until its fence rotated
                seg.fence_out(off, footprint(size))


def demote(t: ObjectTable, keys: list[str], now: float) -> list[int]:
    """The tier call ``evict``: drop the DRAM copies of objects that have a disk record. An object
    without one yet is offered to its provider's writer at its next sync (answered STATE_MISMATCH:
    ask again later)."""
    codes = []
    for k in keys:
        obj = t.objects.get(k)
        if obj is None or not obj.committed:
            codes.append(errors.OBJECT_NOT_EXISTS)
        elif obj.disk is not None:
            t.to_disk_only(obj, now)
            codes.append(errors.SUCCESS)
        else:
            obj.disk_offered = -1.0
            for loc in obj.locations:
                seg = t.segments.get(loc.segment_id)
                if seg is not None and loc.segment_id in t.disk_tiers and seg.lru.get(k) is obj:
                    seg.lru.move_to_end(k, last=False)   # first in its LRU list: offered at the next sync
                    t.disk_tiers[loc.segment_id].scanned = None
            codes.append(errors.STATE_MISMATCH)
    return codes


def prefetch(t: ObjectTable, keys: list[str]) -> list[str]:
    """The admin route ``/memory/prefetch``: per key ``dram`` (a DRAM copy exists), ``queued`` (held on
    a disk tier only: its provider is asked at its next sync to bring it back, as ``prefetch`` does),
    or ``absent``."""
    out = []
    for k in keys:
        obj = t.objects.get(k)
        if obj is None or not obj.committed:
            out.append("absent")
        elif obj.locations or obj.disk is None or obj.disk[0] not in t.disk_tiers:
            out.append("dram" if obj.locations else "absent")
        else:
            wanted = t.disk_wanted.setdefault(obj.disk[0], [])
            if len(wanted) < MAX_DROPS:
                wanted.append(p.ObjectReport(obj.key, 0, obj.size, obj.disk[1], obj.checksum))
            out.append("queued")
    return out
