"""The writer's side of allocation arenas: small puts in one round trip (``meta/arena.py``,
docs/design.md "Small puts").

A put of one replica whose payload is at most ``small_put_max_bytes`` is placed in the arena, a
range of our own segment the MetaService granted us: we pick its offset (bump allocation), copy the
payload there and hash it, then one ``ArenaCommit`` makes the whole batch visible and returns the
generations; the header (``layout.py``), which recovery scans for, is written right after, before
the put returns success. A batch that does not fit asks for a new arena in the same commit
(``refill``) and goes on there: at most two round trips for a batch that fits one arena, one once an
arena is held. What the arena path cannot take (no arena granted, ``ARENA_VOID``, another writer's
put in flight) goes the two-phase way, and so does a key stored already: that put's ``Alloc`` says
where, so a copy held only by a provider of this host that died is put again (``writes.py``).

One lock (``lock``) covers an arena put from placement to the header, the re-join (which scans the
segment and replaces the session: ``Membership._join``) and the clearing of headers the journal
asks for, so that:
* nothing is copied into an arena of an older session: after a re-join the MetaService may have
  handed that space to another writer;
* a scan never misses an object whose put is about to return success;
* an object removed right after its commit never keeps a header (the clear waits for the header).
Small puts of one process therefore run one at a time; each is a local copy and one round trip.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from .. import errors
from .. import protocol as p
from ..errors import MemCacheError
from ..layout import ALIGN, HEADER_BYTES, footprint, pack_header, payload_offset
from ..memory import Mapping, view_at
from ..rpc import expect
from .session import Pieces, Session

if TYPE_CHECKING:
    from ..rpc import RpcClient

logger = logging.getLogger(__name__)

IDLE_S = 60.0     # an arena unused this long is given back (its free part returns to the pool)
MAX_ROUNDS = 3    # commits one batch may take in the arena before the rest goes two-phase
RETRY_S = 10.0    # after the MetaService granted no arena (arena_bytes 0, a full or draining segment, a
                  # placement policy other than local_first), small puts go two-phase this long


@dataclasses.dataclass(slots=True)
class Arena:
    session: Session     # granted to this session: void once it is replaced
    id: int
    start: int
    end: int
    next: int            # the next free offset (bump allocation)
    last_used: float


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ArenaWriter:
    """The arena of one LocalService and the small puts placed in it."""

    def __init__(self, segment: Mapping, rpc: RpcClient, hashing: bool) -> None:
        self.segment = segment
        self.rpc = rpc
        self.hashing = hashing
        self.lock = threading.Lock()
        self.arena: Arena | None = None
        self.commits = 0           # ArenaCommit round trips made (benchmarks count them)
        self.refused_until = 0.0   # no arena was granted: do not ask again before then

    def put(self, session: Session, keys: Sequence[str], pieces: Sequence[Pieces], sizes: Sequence[int]
            ) -> tuple[dict[str, MemCacheError | None], list[int]]:
        """Put what fits in arenas: (result per key done here, indexes of the keys left to the two-phase put)."""
        done: dict[str, MemCacheError | None] = {}
        fallback: list[int] = []
        left = list(range(len(keys)))
        if self.arena is None and time.monotonic() < self.refused_until:
            return done, left
        with self.lock:
            for _ in range(MAX_ROUNDS):
                if not left:
                    break
                a = self.arena if self.arena is not None and self.arena.session is session else None
                placed: list[tuple[int, int]] = []   # (index, offset)
                rest: list[int] = []
                if a is not None:
                    a.last_used = time.monotonic()
                    for i in left:
                        need = _aligned(footprint(sizes[i]))
                        if need > a.end - a.start:
                            fallback.append(i)   # larger than any arena (small_put_max_bytes above arena_bytes)
                        elif rest or a.next + need > a.end:
                            rest.append(i)
                        else:
                            placed.append((i, a.next))
                            a.next += need
                else:
                    rest = left
                if not placed and not rest:
                    break
                sums = [self._copy(off, pieces[i]) for i, off in placed]
                req = p.ArenaCommit(session.client_id, session.token, a.id if a is not None else 0,
                                    [keys[i] for i, _ in placed], [off for _, off in placed],
                                    [sizes[i] for i, _ in placed], sums, refill=bool(rest))
                try:
                    self.commits += 1
                    r = expect(self.rpc.call(req), p.ArenaReply)
                except errors.NotAMember:   # the MetaService restarted: the two-phase put re-joins first
                    return done, fallback + [i for i, _ in placed] + rest
                except MemCacheError as e:   # not known whether it committed: reported failed, as a commit's
                    for i, _ in placed:
                        done[keys[i]] = e
                    return done, fallback + rest
                for (i, off), code, gen, checksum in zip(placed, r.codes, r.generations, sums, strict=True):
                    if code == errors.SUCCESS:
                        view_at(self.segment.addr + off, HEADER_BYTES)[:] = pack_header(keys[i], gen, sizes[i], checksum)
                        done[keys[i]] = None
                    elif code in (errors.ARENA_VOID, errors.WRITE_IN_PROGRESS, errors.OBJECT_ALREADY_EXISTS):
                        # (stored already: the two-phase put's Alloc says where, and whether that is
                        # only with an owner that died: writes.py)
                        fallback.append(i)
                    else:
                        done[keys[i]] = errors.error_from_code(code, f"commit of {keys[i]!r} refused")
                self._install(session, r)
                left = rest
                if self.arena is None:
                    self.refused_until = time.monotonic() + RETRY_S
                    break
        return done, fallback + left

    def _install(self, session: Session, r: p.ArenaReply) -> None:
        """Hold the arena the MetaService says we hold (a new one starts empty)."""
        if not r.arena:
            self.arena = None
        elif self.arena is None or self.arena.id != r.arena or self.arena.session is not session:
            end = r.start + r.size
            if r.start % ALIGN or not 0 <= r.start < end <= self.segment.size:
                logger.error("the MetaService granted an arena [%d, %d) outside our segment of %d bytes; not used",
                             r.start, end, self.segment.size)
                self.arena = None
                return
            self.arena = Arena(session, r.arena, r.start, end, r.start, time.monotonic())

    def _copy(self, offset: int, pieces: Pieces) -> int:
        """Copy the payload to its place in our segment (any old header there is cleared first); its checksum."""
        base = self.segment.addr
        ctypes.memset(base + offset, 0, 8)   # a header left from freed space never describes these bytes
        h = xxhash.xxh3_64() if self.hashing else None
        pos = base + payload_offset(offset)
        for ptr, n in pieces:
            if h is not None:
                h.update(view_at(ptr, n))
            ctypes.memmove(pos, ptr, n)
            pos += n
        return h.intdigest() if h is not None else 0

    def release_idle(self, now: float) -> None:
        """Give back an arena unused for ``IDLE_S`` (from the heartbeat; skipped while a put runs)."""
        a = self.arena
        if a is None or now - a.last_used < IDLE_S or not self.lock.acquire(blocking=False):
            return
        try:
            if self.arena is not a:
                return
            self.arena = None
            s = a.session
            self.rpc.call(p.ArenaCommit(s.client_id, s.token, a.id, [], [], [], [], release=True))
        except MemCacheError as e:
            logger.debug("arena release not delivered (%s); it returns with our segment", e)
        finally:
            self.lock.release()
