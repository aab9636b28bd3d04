"""Generations: the number each write of a key is issued (at alloc, and for a drain's move), and why
they order writes across MetaService lifetimes and HA leader terms.

Recovery keeps the newest generation of a key among the members' reports (``ObjectTable.add_segment``):
after a remove and a re-put that the first holder never heard of, both holders report the key, and the
larger generation must be the later write, whichever MetaService (or leader) issued each. That must
hold without assuming that two hosts' clocks agree.

Generations are issued below a *ceiling*, reserved a block (``BLOCK``) at a time, before any
generation under it is issued; the table takes the next block when half of the current one is left
(``ObjectTable._reserve_ahead``), so every generation issued is at most the ceiling before the last raise,
which was reserved at least ``BLOCK // 2`` (2**31) allocations earlier.

* **HA** (``ha.GenerationReservation``): the ceiling is a key in etcd (``/memcache/<cluster_id>/generations``),
  written with compare-and-swap. A leader's first reservation starts above the value it reads; a
  later one continues its own. Proof: etcd orders the swaps; a leader issues only at or below a
  ceiling its own swap wrote; a new leader reads after every swap of the old one that succeeded
  (a later swap of the old leader fails: the value changed), so it starts above every generation
  the old leader could issue. The old leader serves no request once the new one is elected (fencing,
  ``meta/ha.py``), so nothing is issued from a stale ceiling. No clock is compared across hosts.
* **Without HA** the MetaService keeps nothing durable. Every heartbeat reply and ``Joined`` tells the
  member the current ceiling, and a member carries the highest it has heard into its next ``Join``;
  the MetaService raises its counter above it before answering. A write is made by a member, so it is
  issued after its writer re-joined: above every generation its writer heard of, and since a
  member hears the ceiling every heartbeat while 2**31 allocations take hours, above every
  generation the previous MetaService issued, unless the writer never was a member of it. For that
  one case the first generation is also above ``clock_floor`` (this host's clock, 10 ms ticks
  << 24): it holds when the restarted MetaService's clock is not behind its predecessor's.
"""

from __future__ import annotations

import time

BLOCK = 1 << 32                 # generations reserved at a time
MAX_CARRIED = 1 << 62           # a carried ceiling above this is refused (the space is 63 bits)
_TICK_S = 0.01
_ORIGIN = 1_704_067_200.0       # 2024-01-01 UTC


def clock_floor() -> int:
    """A generation above every one a previous MetaService on this host's clock could have issued
    (10 ms ticks since 2024, shifted by 24 bits)."""
    return int((time.time() - _ORIGIN) / _TICK_S) << 24


def in_memory(last: int, ceiling: int) -> tuple[int, int]:
    """Without HA: the next block starts where the counter is (members learn the ceiling on heartbeats)."""
    return last, max(last, ceiling) + BLOCK
