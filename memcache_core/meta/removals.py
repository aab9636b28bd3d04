"""Removals from the object table: remove (one key, a prefix, all), a corrupt object or replica, the
removal reply naming the headers (and disk records) owners must clear, and taking an object or one replica out (space
freed now or when its lease ends; ``under`` kept in step). A mixin of ``ObjectTable`` (``table.py``
holds the state)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import errors
from ..protocol import Codes
from ..records import Location, ObjectReport
from .objects import Counters, Obj, Segment, new_obj


class Removals:
    """Removals over ``ObjectTable``'s objects (a mixin; the table sets the state)."""

    objects: dict[str, Obj]
    segments: dict[int, Segment]
    counters: Counters
    doomed: list[Obj]
    pending: int
    under: collections.OrderedDict[str, Obj]
    listener: Callable[[bool, Obj, Sequence[Location]], None] | None
    disk_drops: dict[int, list[ObjectReport]]
    disk_tiers: dict[int, Any]
    unconfirmed_records: collections.OrderedDict[tuple[str, int], None]

    if TYPE_CHECKING:   # the table's and ``space.py``'s own, used here
        def _settled(self, obj: Obj) -> None: ...
        def _unkept(self, obj: Obj) -> None: ...

        def _free_space(self, obj: Obj) -> None: ...

        def add_replica(self, obj: Obj, loc: Location) -> None: ...

    def remove(self, key: str, now: float) -> int:
        obj = self.objects.get(key)
        if obj is None or not obj.committed:
            return errors.OBJECT_NOT_EXISTS
        self.counters.removes += 1
        self._unlink(obj, now)
        return errors.SUCCESS

    def remove_prefix(self, prefix: str, now: float) -> int:
        keys = [k for k, o in self.objects.items() if o.committed and k.startswith(prefix)]
        for k in keys:
            self._unlink(self.objects[k], now)
        self.counters.removes += len(keys)
        return len(keys)

    def corrupt(self, key: str, generation: int, now: float, segment_id: int | None = None) -> bool:
        """A reader saw this object's bytes fail their checksum: count it and drop the object, or only
        the replica in ``segment_id`` when others are left (the reader moves on to them)."""
        self.counters.integrity_failures += 1
        obj = self.objects.get(key)
        if obj is None or not obj.committed or obj.generation != generation:
            return False
        bad = [loc for loc in obj.locations if loc.segment_id == segment_id]
        if bad and (len(obj.locations) > 1 or obj.disk is not None):
            self._drop_replica(obj, bad[0], now)
        else:
            self._unlink(obj, now)
        return True

    def _drop_replica(self, obj: Obj, loc: Location, now: float) -> None:
        """Take one replica out of a committed object; its space is freed once the object's lease ends."""
        seg = self.segments.get(loc.segment_id)
        if seg is not None:   # out of its LRU list before the location goes (the list finds its links by it)
            if seg.lru.get(obj.key) is obj:
                del seg.lru[obj.key]
            seg.record_removed(ObjectReport(obj.key, loc.offset, obj.size, obj.generation, obj.checksum))
        obj.locations = [x for x in obj.locations if x != loc]
        gone = new_obj(obj.key, obj.size, obj.generation, [loc], lease_until=obj.lease_until)
        if gone.lease_until > now:
            self.doomed.append(gone)
        else:
            self._free_space(gone)
        self._mark(obj)

    def move_replica(self, obj: Obj, src: Location, dst: Location, now: float) -> None:
        """A committed object's replica at ``src`` is replaced by its copy at ``dst``, made and checked
        (re-replication spreading its copies); ``src``'s space is freed once the object's lease ends."""
        self.add_replica(obj, dst)
        if self.listener is not None:   # KV events: the replica at src is removed
            self.listener(False, obj, [src])
        self._drop_replica(obj, src, now)

    def removing(self, remove: Callable[[], list[int]], epoch: int) -> Codes:
        """Run a removal; the reply names each segment whose owner must clear headers (``confirmed``)."""
        before = {sid: seg.journal_seq for sid, seg in self.segments.items()}
        codes = remove()
        return Codes(codes, [(sid, seg.serial, seg.journal_seq) for sid, seg in self.segments.items()
                             if seg.journal_seq != before.get(sid)], epoch)

    def confirmed(self, segment_id: int, serial: int, seq: int) -> bool:
        """Has the owner cleared the headers journaled up to ``seq`` (acknowledged them on a heartbeat)?
        A segment no longer in the table (its owner left or was declared dead), or in it again after a
        re-join, has nothing to wait for: a re-joining owner's reports of removed objects are refused
        (``unconfirmed``)."""
        seg = self.segments.get(segment_id)
        return seg is None or seg.serial != serial or seg.acked >= seq

    def remove_all(self, now: float) -> int:
        keys = [k for k, o in self.objects.items() if o.committed]
        for k in keys:
            self._unlink(self.objects[k], now)
        self.counters.removes += len(keys)
        return len(keys)

    def _mark(self, obj: Obj) -> None:
        """Keep ``under`` in step with this object's replica count."""
        if obj.more is None:   # one replica asked for, not marked: nothing to change
            return
        under = (obj.committed and 0 < len(obj.locations) < obj.replicas  # disk-only objects are not "under"
                 and self.objects.get(obj.key) is obj)
        if under:
            self.under.setdefault(obj.key, obj)   # (already there: keeps its place in the visiting order)
        elif self.under.get(obj.key) is obj:
            del self.under[obj.key]

    def _drop_records(self, obj: Obj) -> None:
        """An object left the pool: the disk tier holding its record, and each disk tier its DRAM copies
        may be being written to (an offered copy not reported yet), delete the record through the
        owner's journal, before the owner acknowledges it: a remove's confirmation covers the disk."""
        sids = {loc.segment_id for loc in obj.locations if loc.segment_id in self.disk_tiers}
        if obj.disk is not None:
            sids.add(obj.disk[0])
            obj.disk = None
        for sid in sids:
            seg = self.segments.get(sid)
            if seg is not None:
                seg.record_removed(ObjectReport(obj.key, -1, obj.size, obj.generation, obj.checksum), disk=True)

    def removed_records(self) -> set[tuple[str, int]]:
        """(key, generation) of disk records of objects that left the pool whose deletion no owner has
        acknowledged: a provider joining with one (restarted on that disk_path) has it refused."""
        out = set(self.unconfirmed_records)
        for seg in self.segments.values():
            out.update((e.obj.key, e.obj.generation) for e in seg.journal if e.disk and e.seq > seg.acked)
        return out

    def _unlink(self, obj: Obj, now: float = 0.0, keep_space: bool = False) -> None:
        """Take the object out of the table; free its space now, or when its lease ends."""
        for loc in obj.locations:   # out of the LRU lists first: they find neighbours in ``objects``
            seg = self.segments.get(loc.segment_id)
            if seg is None:
                continue
            seg.lru.discard(obj)
            seg.record_removed(ObjectReport(obj.key, loc.offset, obj.size, obj.generation, obj.checksum))
        if self.objects.get(obj.key) is obj:
            del self.objects[obj.key]
            if not obj.committed:
                self.pending -= 1
                self._settled(obj)
            else:
                self._unkept(obj)
                if self.listener is not None:
                    self.listener(False, obj, obj.locations)
            self._drop_records(obj)
        self._mark(obj)
        if keep_space:
            return
        if obj.committed and obj.lease_until > now:
            self.doomed.append(obj)
        else:
            self._free_space(obj)
