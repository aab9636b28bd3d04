"""Where keys were last seen: a get of such a key copies while its ``Lookup`` is on the way.

A get needs the ``Lookup`` round trip before it can copy; where the MetaService's core has been idle,
waking it costs more than the round trip itself. So a client remembers, for the keys its last
lookups found, the object each one named (size, generation, locations, checksum). A get of keys it
remembers sends its ``Lookup`` and, before reading the reply, copies those objects from where they
were (``reads.py``). The copy counts only if the reply names the same object at the same place:

* a generation names one object for good: generations are issued in increasing order below a
  reserved ceiling (``meta/generations.py``), never twice, also across MetaService restarts;
* a committed object's bytes never change, and its space is not reused while the object is in the
  table (removed or evicted objects leave the table first; a lease holds the space after that);
* so if the object was in the table when it was remembered and is there still when the MetaService
  answers (holding a lease on it from then on), it was there all the time in between, at that
  place, with those bytes: the copy made in between read them.

Anything else (another generation, another place, a missing key, a failed lookup) throws the early
copy away: the key is read again from the reply's locations, or is a miss. A hint is only a guess
of where to read; it is never an answer.

A thrown-away copy costs a copy. Where the keys a client reads keep being removed and put again
(eviction churn on a hot key set, or a writer replacing objects), most early copies would be thrown
away and gets would copy twice; so a client that sees that stops copying early and tries again on
one get in ``PROBE_EVERY``, until early copies are mostly used again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from .. import protocol as p

PROBE_EVERY = 16      # gets between two tries while early copies are mostly thrown away
TRUST_FLOOR = 0.5     # below this share of early copies used (a moving average), stop copying early
WEIGHT = 0.25         # of the newest get in that average


class LocationHints:
    """The last ``capacity`` keys' objects, least recently seen dropped first; 0: remembers nothing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hints: OrderedDict[str, p.Found] = OrderedDict()
        self._lock = threading.Lock()
        self.trust = 1.0      # moving average of the share of early copies used
        self._skipped = 0

    def worth_trying(self) -> bool:
        """Whether this get should copy early: yes while early copies are mostly used, else one get
        in ``PROBE_EVERY``."""
        if not self.capacity:
            return False
        if self.trust >= TRUST_FLOOR:
            return True
        self._skipped += 1
        return self._skipped % PROBE_EVERY == 0

    def outcome(self, used: int, discarded: int) -> None:
        """How the early copies of one get went."""
        if used + discarded:
            self.trust += WEIGHT * (used / (used + discarded) - self.trust)

    def __len__(self) -> int:
        return len(self._hints)

    def get(self, keys: Iterable[str]) -> list[p.Found | None]:
        with self._lock:
            return [self._hints.get(k) for k in keys]

    def seen(self, keys: Iterable[str], found: Iterable[p.Found | None]) -> None:
        """What a lookup answered: objects held in DRAM are remembered, the others forgotten."""
        if not self.capacity:
            return
        hints = self._hints
        with self._lock:
            for k, f in zip(keys, found, strict=True):
                if f is not None and f.locations:
                    hints[k] = f
                    hints.move_to_end(k)
                else:
                    hints.pop(k, None)
            while len(hints) > self.capacity:
                hints.popitem(last=False)

    def forget(self, keys: Iterable[str] | None = None) -> None:
        """Drop these keys (None: all)."""
        with self._lock:
            if keys is None:
                self._hints.clear()
                return
            for k in keys:
                self._hints.pop(k, None)
