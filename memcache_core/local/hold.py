"""A segment *held* after a re-join (docs/design.md, "Failure of the MetaService"; ``fence.py``).

Before every join the owner sets its segment's fence to 0 and waits for the writes in flight into it
(granted before this join) to end: it takes the fence's lock exclusive. A writer frozen mid-copy, or
any process of the host holding a shared lock on the fence page, would hold that wait for as long as it
likes, and with it the owner's whole cache out of the pool. So the wait is bounded (``fence_wait_ms``):
past it the owner joins anyway with its segment held (``Join.held``, then ``Heartbeat.held`` at every
beat): its committed objects are reported and served (a write in flight lands only in space granted to
it, never in a committed object's), but the MetaService places nothing new in the segment. The fence
stays 0 meanwhile, so every writer of an earlier grant is refused as before. A thread keeps waiting for
the lock; once it has it, it opens the fence to the current join's token and the hold is over (the
next heartbeat says so).

The same step *rotates* the fence without a join, when the MetaService asks for it (``HeartbeatReply.rotate``):
it reclaimed a grant in this segment whose writer may be frozen, not dead, still holding the current
token. The fence goes to 0, the writes in flight are waited out (bounded, then held, as above) and the
fence opens to the new token; the heartbeat reports it (``Heartbeat.fence``), and only then does the
MetaService grant with it and give the reclaimed space to another object (docs/design.md, "Cleanup of
half-written objects"). A writer of the reclaimed grant that wakes up finds another token: refused.
"""

from __future__ import annotations

import logging
import threading
import time

from ..fence import Fence

logger = logging.getLogger(__name__)

POLL_S = 0.01   # the waiter tries the lock this often (the bounded wait before a join: ``fence.drained``'s)


class Hold:
    """The fence of this member's segment across joins: closed before each, opened after it, or held."""

    def __init__(self, fence: Fence, wait_s: float, join_lock: threading.Lock, stop: threading.Event,
                 beat_now: threading.Event) -> None:
        self.fence = fence
        self.wait_s = wait_s
        self.held = False          # writes of an earlier join may still be in flight: nothing new goes here
        self._token = 0            # the current join's fence token (the waiter opens the fence to it)
        self._join_lock = join_lock
        self._stop = stop
        self._beat_now = beat_now
        self._since = 0.0
        self._waiter: threading.Thread | None = None
        self._rotator: threading.Thread | None = None

    @property
    def open_to(self) -> int:
        """The token the fence is open to alone (0: held: writes of another may still be in flight)."""
        return 0 if self.held else self._token

    def close(self, why: str = "this re-join") -> None:
        """Before a join (under the join lock): fence 0, and wait up to ``wait_s`` for the writes in
        flight to end; past it the segment is held (said once). Held already: the fence is 0 and the
        waiter waits on."""
        if self.held or self.fence.move(0, self.wait_s):
            return
        self.held, self._since = True, time.monotonic()
        pids = ", ".join(map(str, self.fence.holders())) or "not named by this kernel"
        logger.warning("segment %s: writes granted before %s are still in flight after %g ms (fence_wait_ms; "
                       "lock holders: %s): a writer frozen mid-copy, or a process holding the fence page's lock. "
                       "The segment is held: its objects are served, but no new object is placed in it until "
                       "they end", self.fence.path, why, self.wait_s * 1000, pids)

    def rotate(self, token: int) -> None:
        """The MetaService asks for the fence at ``token`` (it reclaimed grants here): on a thread of its
        own (the wait is ``close``'s, and the heartbeat must go on), unless one is at it already."""
        if token == self._token or (self._rotator is not None and self._rotator.is_alive()):
            return
        self._rotator = threading.Thread(target=self._rotate, args=(token, self._token), name="memcache-fence-rotate",
                                         daemon=True)
        self._rotator.start()

    def _rotate(self, token: int, was: int) -> None:
        with self._join_lock:
            if self._stop.is_set() or self._token != was:   # a (re-)join meanwhile: its token stands
                return
            self.close("the fence's rotation (grants reclaimed by the MetaService)")
            self.open(token)
        logger.info("segment %s: write fence rotated (grants reclaimed by the MetaService are void)%s",
                    self.fence.path, "; held until the writes in flight end" if self.held else "")
        self._beat_now.set()   # (the MetaService frees the reclaimed space once it hears of it)

    def open(self, token: int) -> None:
        """After a join (under the join lock): writes of its ``token`` land from now on; held, once the
        waiter had the lock."""
        self._token = token
        if not self.held:
            self.fence.open(token)
        elif self._waiter is None or not self._waiter.is_alive():
            self._waiter = threading.Thread(target=self._wait_out, name="memcache-fence-hold", daemon=True)
            self._waiter.start()

    def _wait_out(self) -> None:
        while not self.fence.drained(1.0, POLL_S):
            if self._stop.is_set():
                return
        with self._join_lock:
            if self._stop.is_set():
                return
            self.fence.open(self._token)   # the join of now's (a re-join meanwhile left the fence at 0)
            self.held = False
        logger.warning("segment %s: the writes in flight since before the re-join ended after %.1f s; the hold "
                       "is over: the segment takes new objects again", self.fence.path, time.monotonic() - self._since)
        self._beat_now.set()
