"""Placement policies: the order in which a new object's segments are tried (``placement_policy``).

* ``local_first`` (the default, Ascend MemCache's): the writer's own segment, so that a put is a
  local memcpy; the other segments (and every segment for a writer without one: a pure client)
  in ``spread`` order.
* ``spread``: the segments with the most free space *as a fraction of their size* first, chosen by
  "the better of two random choices": each place in the order goes to the freer of two segments
  drawn at random from those not yet placed. A provider restarted empty is therefore first for
  about 2 of every N puts (N segments), not for every put until it has caught up with the others:
  it fills faster than the rest, without becoming the one hot spot that all writers and, later,
  all readers hit. With two segments the freer one is always first.
* ``random``: a uniformly random order (for pools of equal providers where free space says little).

The writer's ``preferredLocalServiceIDs`` come before all of these (``ObjectTable.alloc`` takes them
first). Replicas beyond the first go, in this order, to segments on other hosts first.
The random source is the MetaService's own, seeded from the OS, never an application's ``random``.

Copies (a drain's moves, re-replication) go to the segments that may take them in ``spread`` order
too, drawn from the OS's random source: two providers that join empty share the copies about
evenly, instead of the first one to join taking them all (one later loss would then lose them all).
When none has room under the high-water mark, a copy makes room by evicting colder objects
(``room.py``).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Mapping

from ..layout import footprint
from . import room
from .allocator import aligned
from .table import Obj, ObjectTable, Segment

COPY_RNG = random.SystemRandom()   # the OS's random source: no application can seed it


def free_ratio(seg: Segment) -> float:
    a = seg.allocator
    return a.free / a.size if a.size else 0.0


def spread(segments: Mapping[int, Segment], rng: random.Random, skip: int | None = None) -> Iterator[int]:
    """Segment ids, each place the freer (by ratio) of two random picks among those left. Lazy: a put
    usually needs the first one or two, so that is all it pays for (O(1) each)."""
    left = [s for s in segments if s != skip] if skip is not None else list(segments)
    while len(left) > 1:
        i = rng.randrange(len(left))
        j = rng.randrange(len(left) - 1)
        j += j >= i
        pick = i if free_ratio(segments[left[i]]) >= free_ratio(segments[left[j]]) else j
        left[pick], left[-1] = left[-1], left[pick]
        yield left.pop()
    yield from left


def shuffled(segments: Mapping[int, Segment], rng: random.Random) -> Iterator[int]:
    """Segment ids in a uniformly random order, drawn lazily."""
    left = list(segments)
    while left:
        i = rng.randrange(len(left))
        left[i], left[-1] = left[-1], left[i]
        yield left.pop()


def order(policy: str, segments: Mapping[int, Segment], own: int | None, rng: random.Random) -> Iterator[int]:
    """The order in which segments are tried for one new object (after the preferred ones)."""
    if policy == "random":
        return shuffled(segments, rng)
    if policy == "local_first" and own is not None and own in segments:
        return itertools.chain((own,), spread(segments, rng, skip=own))
    return spread(segments, rng)


def copy_takers(table: ObjectTable, now: float) -> list[Segment]:
    """The segments that may take a copy now (they take new objects: ``Segment.takes_new``)."""
    return [s for s in table.segments.values() if s.takes_new(now) and s.allocator.size]


def copy_target(table: ObjectTable, obj: Obj, avoid: set[int], answering: Callable[[int, float], bool],
                now: float, replacing: int | None = None, takers: list[Segment] | None = None,
                rng: random.Random = COPY_RNG) -> tuple[Segment, int] | bool:
    """Space for one more copy of a committed object (a drain's move, a repair's new replica) in one of
    the ``takers`` (default: ``copy_takers``) that holds no replica of it, is not in ``avoid`` and whose
    owner answers; hosts holding no replica first (``replacing``: the replica the copy replaces, whose
    host does not count). In each group: a segment that stays under the high-water mark, in ``spread``
    order (freer by ratio, with randomness); else one where evicting objects colder than this one makes
    room (``room.evicting``: never a hotter or a leased one). Returns (segment, offset); else True when
    only segments whose owners are silent right now have room (wait for them), False when none has."""
    need = aligned(footprint(obj.size))
    holders = {loc.segment_id for loc in obj.locations}
    hosts = {table.segments[s].info.host_id for s in holders if s in table.segments and s != replacing}
    first: list[Segment] = []
    then: list[Segment] = []
    for s in copy_takers(table, now) if takers is None else takers:
        sid = s.info.segment_id
        if sid not in holders and sid not in avoid:
            (then if s.info.host_id in hosts else first).append(s)
    silent = False
    for group in (first, then):
        roomy = [s for s in group if s.allocator.used + need <= table.high * s.allocator.size]
        for s in _spread_list(roomy, rng):
            if not answering(s.info.segment_id, now):   # a loaded host's heartbeat, or a dead owner
                silent = True
                continue
            off = s.allocator.alloc(need)
            if off is not None:
                return s, off
        placed = room.evicting(table, obj, [s for s in group if answering(s.info.segment_id, now)], now)
        if placed is not None:
            return placed
    return silent


def _spread_list(segs: list[Segment], rng: random.Random) -> Iterator[Segment]:
    by_id = {s.info.segment_id: s for s in segs}
    return (by_id[sid] for sid in spread(by_id, rng))
