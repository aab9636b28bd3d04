"""Replays of KV-event batches (vLLM's protocol), served on a thread of their own within bounds.

The protocol is vLLM's publisher's: a request ``[b"", start_seq (8 bytes, big endian)]`` on the ROUTER
socket is answered with every kept batch from that sequence on, each as ``[b"", seq, payload]``, then
``[b"", -1 (8 bytes, signed), b""]``. A replay holds the batches kept when it was asked for (up to the
last sequence then); batches that leave the kept window before their turn are skipped, as they would
be had they left before the request.

Without CURVE anyone who reaches the port may ask, so nothing here can keep the live stream waiting:
the publisher's thread only appends to ``KeptBatches`` (a lock held for a dict insert), and this
thread, which alone touches the ROUTER socket (ZeroMQ sockets belong to one thread), serves within:

* ``requests_per_second`` requests read from the socket, all peers together (a token bucket holding
  one second's worth). Requests beyond it wait in ZeroMQ's queue of their connection (``RCVHWM``
  requests; past that ZeroMQ stops reading the connection), which ZeroMQ reads round robin: a flood
  from some connections delays an honest request by one turn of the connections, no more.
* ``bytes_per_second`` of batches sent, all replays together, each batch counted as at least
  ``MIN_CHARGE`` bytes (its fixed cost); the replays in progress take turns of ``TURN`` batches.
* per peer (a connection: ZeroMQ gives each its own identity): one replay at a time and at least
  ``min_interval_s`` between the starts of two; at most ``MAX_ACTIVE`` replays in progress in all.
  A request beyond these is dropped and counted (``dropped``, by reason); a peer whose queue is full
  (``SNDHWM`` batches) is retried after ``RETRY_S``, and one that takes nothing for ``STALL_S`` loses
  the rest of its replay (counted). A request frame over ``MAX_REQUEST`` bytes makes ZeroMQ close the
  connection.
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
RCVHWM = 16          # requests queued per connection before ZeroMQ stops reading it
SNDHWM = 1000        # batches queued per connection; then that replay waits
MAX_REQUEST = 1024   # bytes of one frame (a request needs 8, CURVE's handshake a few hundred); more: ZeroMQ closes the connection
MAX_ACTIVE = 64      # replays in progress at once
MIN_CHARGE = 1024    # what one batch costs the byte budget at least
TURN = 64            # batches one replay sends before the next one's turn
RETRY_S = 0.05       # a replay whose peer's queue is full is tried again after this
STALL_S = 5.0        # a replay whose peer took nothing this long is given up
READS_PER_PASS = 256
LOG_EVERY_S = 10.0   # drops are logged at most this often
DROP_REASONS = ("malformed", "busy", "too_soon", "full", "stalled", "gone")


@dataclass(frozen=True)
class ReplayLimits:
    """The configured bounds (``kv_events_replay_*``)."""
    requests_per_second: float = 100
    bytes_per_second: float = 32 << 20
    min_interval_s: float = 0.1


class KeptBatches:
    """The last ``steps`` batches by sequence number (sequences are consecutive from 0): the publisher
    adds, the replay thread reads; each call holds the lock for a few dict operations."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._lock = threading.Lock()
        self._batches: dict[int, bytes] = {}
        self._last = -1

    def append(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self._batches[seq] = payload
            self._batches.pop(seq - self.steps, None)
            self._last = seq

    def last(self) -> int:
        with self._lock:
            return self._last

    def since(self, seq: int, end: int, limit: int) -> list[tuple[int, bytes]]:
        """At most ``limit`` kept batches from ``seq`` (or the oldest kept, if later) to ``end``."""
        with self._lock:
            start = max(seq, self._last - self.steps + 1, 0)
            stop = min(end, self._last, start + limit - 1)
            return [(q, self._batches[q]) for q in range(start, stop + 1)]


class Bucket:
    """A token bucket holding one second's worth of ``rate``; ``take`` may leave it in debt."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate, self.tokens, self._at = rate, rate, now

    def refill(self, now: float) -> None:
        self.tokens = min(self.rate, self.tokens + (now - self._at) * self.rate)
        self._at = now

    def wait_s(self, need: float) -> float:
        """How long until the bucket holds ``need``."""
        return max(0.0, (need - self.tokens) / self.rate)


@dataclass
class Replay:
    ident: bytes
    next: int                    # the next sequence to send
    end: int                     # the last sequence kept when it was asked for
    retry_at: float = 0.0        # its peer's queue was full: not before this
    blocked_since: float | None = None   # when its peer's queue was first found full, since its last batch


class ReplayServer:
    """Owns the bound ROUTER ``sock`` (its options set before the bind: ``socket_options``) from here on
    and serves replays of ``kept`` on its own thread until ``close``."""

    def __init__(self, sock: Any, kept: KeptBatches, limits: ReplayLimits) -> None:
        self._sock, self._kept, self.limits = sock, kept, limits
        now = time.monotonic()
        self._requests = Bucket(limits.requests_per_second, now)
        self._bytes = Bucket(limits.bytes_per_second, now)
        self._active: collections.OrderedDict[bytes, Replay] = collections.OrderedDict()
        self._started: dict[bytes, float] = {}    # identity -> when its last replay started
        self._pruned_at = now
        self.served = 0         # replays sent whole
        self.bytes_sent = 0     # payload bytes of replayed batches
        self.dropped = collections.Counter(dict.fromkeys(DROP_REASONS, 0))   # requests (and replays) by reason
        self._logged_at, self._logged_drops = now, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meta-kv-replay", daemon=True)
        self._thread.start()

    @staticmethod
    def socket_options() -> dict[int, int]:
        import zmq
        return {zmq.RCVHWM: RCVHWM, zmq.SNDHWM: SNDHWM, zmq.MAXMSGSIZE: MAX_REQUEST, zmq.ROUTER_MANDATORY: 1}

    def stats(self) -> dict[str, Any]:
        """What ``/kv_events/status`` shows of the replays (read from another thread: plain counters)."""
        return {"active": self._thread.is_alive(), "served": self.served, "bytes_sent": self.bytes_sent,
                "in_progress": len(self._active), "dropped": sum(self.dropped.values()),
                "dropped_by_reason": dict(self.dropped)}

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._read(now)
                sent = self._send(now)
                self._housekeep(now)
                if not sent:
                    self._wait(time.monotonic())
        except Exception:   # a bug here must not pass silently: the port stops answering, said once
            logger.exception("KV events: the replay thread failed; replays are no longer served")
        finally:
            self._sock.close()

    def _read(self, now: float) -> None:
        import zmq
        self._requests.refill(now)
        for _ in range(READS_PER_PASS):
            if self._requests.tokens < 1 or not self._sock.poll(0, zmq.POLLIN):
                return
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._requests.tokens -= 1
            self._admit(frames, now)

    def _admit(self, frames: list[bytes], now: float) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.dropped["malformed"] += 1
            return
        ident, start = frames[0], int.from_bytes(frames[2], "big")
        if ident in self._active:
            self.dropped["busy"] += 1
        elif now - self._started.get(ident, -1e18) < self.limits.min_interval_s:
            self.dropped["too_soon"] += 1
        elif len(self._active) >= MAX_ACTIVE:
            self.dropped["full"] += 1
        else:
            self._started[ident] = now
            self._active[ident] = Replay(ident, start, self._kept.last())

    def _send(self, now: float) -> bool:
        """One turn of every replay that may send now; whether any batch or end went out."""
        import zmq
        self._bytes.refill(now)
        sent = False
        for r in list(self._active.values()):
            if self._bytes.tokens <= 0:
                break
            if r.retry_at > now:
                continue
            try:
                for seq, payload in self._kept.since(r.next, r.end, TURN):
                    self._sock.send_multipart([r.ident, b"", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                    r.next, r.blocked_since, sent = seq + 1, None, True
                    self._bytes.tokens -= max(len(payload), MIN_CHARGE)
                    self.bytes_sent += len(payload)
                    if self._bytes.tokens <= 0:
                        break
                if not self._kept.since(r.next, r.end, 1):   # all sent (or gone from the window): the end
                    self._sock.send_multipart([r.ident, b"", END_SEQ, b""], zmq.NOBLOCK)
                    del self._active[r.ident]
                    self.served += 1
                    sent = True
                    continue
            except zmq.Again:                       # its peer's queue is full: the others go on
                r.retry_at = now + RETRY_S
                r.blocked_since = now if r.blocked_since is None else r.blocked_since
                if now - r.blocked_since > STALL_S:
                    self._give_up(r, "stalled")
                    continue
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    raise
                self._give_up(r, "gone")            # the peer disconnected
                continue
            self._active.move_to_end(r.ident)       # its turn is over
        return sent

    def _give_up(self, r: Replay, reason: str) -> None:
        self._active.pop(r.ident, None)
        self.dropped[reason] += 1

    def _housekeep(self, now: float) -> None:
        if now - self._pruned_at > 1.0:
            self._pruned_at = now
            self._started = {i: t for i, t in self._started.items()
                             if now - t < self.limits.min_interval_s or i in self._active}
        total = sum(self.dropped.values())
        if total > self._logged_drops and now - self._logged_at >= LOG_EVERY_S:
            logger.warning("KV events: %d replay requests or replays dropped in the last %.0f s (by reason, since "
                           "start: %s); replays are bounded by kv_events_replay_requests_per_second, "
                           "kv_events_replay_bytes_per_second and kv_events_replay_min_interval_ms",
                           total - self._logged_drops, now - self._logged_at, dict(self.dropped))
            self._logged_at, self._logged_drops = now, total

    def _wait(self, now: float) -> None:
        """Nothing was sent: wait for a request, a token, or the next retry, at most 0.1 s."""
        import zmq
        timeout = 0.1
        if self._active:
            timeout = min(timeout, max(0.001, min(r.retry_at for r in self._active.values()) - now),
                          max(0.001, self._bytes.wait_s(1)))
        if self._requests.tokens >= 1:
            self._sock.poll(max(1, int(timeout * 1000)), zmq.POLLIN)
        else:
            self._stop.wait(min(timeout, max(0.001, self._requests.wait_s(1))))

    def close(self, timeout_s: float = 2.0) -> bool:
        """Stop the thread (it closes the socket); whether it ended."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
