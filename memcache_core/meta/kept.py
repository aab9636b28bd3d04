"""What each member keeps in the pool: the count of committed objects (and their payload bytes) each
writer has in the table, for the ``member_max_objects`` / ``member_max_bytes`` quotas, and the eviction
of a writer's own objects at its quota. A mixin of ``ObjectTable`` (``table.py`` holds the state).

Each committed object carries its writer as a slot (``Obj.writer_slot``, 12 bits of its packed int:
no byte more per object); a writer holds a slot while it keeps an object. Objects recovered from the
members' reports (a MetaService restart, an HA failover) carry none: headers do not name a writer.

An object that another member holds a GVA lease on (``gva.py``) cannot be evicted, so its writer could
not make room under its quota: while such a lease lasts the object is *lent* (``lent``, ``lent_of``),
counted against the leaser (its ``member_max_leases``) and not in its writer's quota, so no member's
lease turns another's quota into refusals. Leases are bounded in length (``gva_lease_max_ms``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .objects import WRITER_SLOTS, Counters, Obj, Segment

__all__ = ["OWN_LOOKAHEAD", "WRITER_SLOTS", "Kept"]

OWN_LOOKAHEAD = 256   # objects looked at, least recent first, for one of a writer's own to evict (``evict_own``)


class Kept:
    """Per-writer counts of ``ObjectTable``'s committed objects (a mixin; the table sets the state)."""

    segments: dict[int, Segment]
    counters: Counters
    kept_of: dict[int, list[int]]
    lent: dict[str, tuple[int, Obj]]     # key -> (writer, object) of objects another member leases
    lent_of: dict[int, list[int]]        # writer -> [its lent objects, their payload bytes]
    held: dict[str, dict[int, tuple[int, float]]]
    objects: dict[str, Obj]
    slot_of: dict[int, int]
    writer_in: dict[int, int]
    _free_slots: list[int]

    if TYPE_CHECKING:   # ``removals.py``'s, used here
        def _unlink(self, obj: Obj, now: float = 0.0, keep_space: bool = False) -> None: ...

    def writer_slot_of(self, writer: int) -> int:
        """The slot a writer's committed objects carry; 0 (counted against no one) when none is free:
        4,095 other writers keep objects. (Refusing its put instead would let an insider that joins
        4,095 times lock every new writer out; counted against no one, it escapes a quota only with
        4,095 memberships, that is 4,095 quotas, already.)"""
        slot = self.slot_of.get(writer)
        if slot is None:
            if not writer:
                return 0
            if not self._free_slots:
                self.counters.uncounted_writes += 1
                return 0
            slot = self.slot_of[writer] = self._free_slots.pop()
            self.writer_in[slot] = writer
            self.kept_of[writer] = [0, 0]
        return slot

    def evict_own(self, writer: int, now: float) -> bool:
        """Evict one of the writer's own committed, unleased objects to make room under its quota (as a
        full segment evicts): the first found from the least recent end of the segments' LRU lists,
        the writer's own segment first (where ``local_first`` placement puts its objects), looking at
        ``OWN_LOOKAHEAD`` objects at most in all. False: none found, the Alloc is refused."""
        slot = self.slot_of.get(writer)
        if slot is None:
            return False
        budget = OWN_LOOKAHEAD
        own = self.segments.get(writer)   # a member's segment id is its client id
        for seg in ([own] if own is not None else []) + [s for s in self.segments.values() if s is not own]:
            for obj in seg.lru.values():
                if obj.writer_slot == slot and obj.lease_until <= now:
                    self.counters.evictions += 1
                    self.counters.evicted_bytes += obj.size
                    self._unlink(obj, now)
                    return True
                budget -= 1
                if budget <= 0:
                    return False
        return False

    def quota_kept(self, writer: int) -> tuple[int, int]:
        """(objects, bytes) the writer keeps that count in its quota: those no other member leases."""
        kept, kept_bytes = self.kept_of.get(writer, (0, 0))
        lent, lent_bytes = self.lent_of.get(writer, (0, 0))
        return kept - lent, kept_bytes - lent_bytes

    def relend(self, key: str) -> None:
        """The GVA leases on ``key`` changed: it is lent while a member other than its writer holds a
        lease on its current generation."""
        obj = self.objects.get(key)
        writer = self.writer_in.get(obj.writer_slot) if obj is not None and obj.committed else None
        holders = self.held.get(key, {})
        lend = obj is not None and writer is not None and any(
            c != writer and g == obj.generation for c, (g, _) in holders.items())
        old = self.lent.get(key)
        if old is not None and (not lend or old[1] is not obj or old[0] != writer):
            self._unlend(key)
            old = None
        if lend and old is None and obj is not None and writer is not None:
            self.lent[key] = (writer, obj)
            mine = self.lent_of.setdefault(writer, [0, 0])
            mine[0] += 1
            mine[1] += obj.size

    def _unlend(self, key: str) -> None:
        writer, obj = self.lent.pop(key)
        mine = self.lent_of[writer]
        mine[0] -= 1
        mine[1] -= obj.size
        if mine[0] <= 0:
            del self.lent_of[writer]

    def _unkept(self, obj: Obj) -> None:
        """A committed object left the table: its writer's count of kept objects is given back."""
        lent = self.lent.get(obj.key)
        if lent is not None and lent[1] is obj:
            self._unlend(obj.key)
        slot = obj.writer_slot
        writer = self.writer_in.get(slot)
        if writer is None:
            return
        kept = self.kept_of[writer]
        kept[0] -= 1
        kept[1] -= obj.size
        if kept[0] <= 0:
            del self.kept_of[writer], self.slot_of[writer], self.writer_in[slot]
            self._free_slots.append(slot)

    def count_kept(self, writer: int, obj: Obj) -> None:
        """A committed object of ``writer`` (which holds a slot) joined the table."""
        kept = self.kept_of[writer]
        kept[0] += 1
        kept[1] += obj.size
