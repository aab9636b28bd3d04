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
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Mapping

from .table import Segment


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
