"""Cross-host transfers through NIXL over UCX: one-sided READs and WRITEs of a peer's segment.

Each LocalService (``transfer_engine: "nixl"``) runs a NIXL agent for its own requests; a provider runs
a second one that serves its segment: it registers the segment with it and puts that agent's metadata
(which holds the region's remote key: a capability to read and write that memory) and the region's
address in its ``SegmentInfo.nixl``. That travels only through the MetaService's authenticated RPC
port (``Join``, ``GetSegments``); the status page, metrics and logs never show it. A peer loads the
metadata on first use and moves the pieces of a batch in one request (a read: one per slice, all in
flight at once), straight between its registered buffers and the segment; the owner's Python does
nothing per transfer. Pieces outside registered memory are not ours to hand to NIXL: the engine sends
them through the built-in TCP path instead.

The initiator drives its own requests by polling ``check_xfer_state`` until a deadline: a failed or
timed-out transfer raises (a miss or a failed put for its keys), never hangs. Only a provider's serving
agent has NIXL's progress thread (a peer's emulated READ over UCX's tcp transport is served by it); its
poll timeout and the UCX defaults are set in ``nixl_agent.py``. Teardown is explicit and ordered
(``close``, and at interpreter exit for a transport left open), and the UCX backend is probed in a
child process before this one makes it (``nixl_agent.py``): a misbehaving optional transport must not
crash the process that hosts the pool.
"""

from __future__ import annotations

import atexit
import bisect
import dataclasses
import gc
import importlib.util
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from ..errors import InvalidParameter, PeerUnavailable, TransferFailed
from ..memory import Mapping
from ..records import SegmentInfo
from .nixl_agent import make_agent, own_nixl_logging
from .nixl_descriptor import Descriptor, checked

logger = logging.getLogger(__name__)

SPIN_S = 0.001                # poll back to back this long, then with yields for the bytes' time at
SPIN_FLOOR = 1e9              # SPIN_FLOOR, then sleep SLEEP_S between polls (over tcp, our polls move the bytes)
SLEEP_S = 0.00005
SCRATCH_BYTES = 64 << 10      # registered buffers for object headers (written after the payload)
INSTALL = "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"

Ranges = list[tuple[int, list[tuple[int, int]]]]   # (segment offset, [(local pointer, size), ...])


@dataclasses.dataclass(slots=True)
class _Peer:
    """A loaded remote agent and the requests using it."""

    name: str
    descriptor: Descriptor
    refs: int = 0
    retired: bool = False


@dataclasses.dataclass(slots=True)
class _Flight:
    """One posted request."""

    op: str
    segment_id: int
    nbytes: int
    handle: Any = None
    state: str = "DONE"

    def poll(self, agent: Any) -> str:
        if self.state == "PROC":
            self.state = agent.check_xfer_state(self.handle)
        if self.state not in ("PROC", "DONE"):
            raise PeerUnavailable(f"NIXL {self.op} with segment {self.segment_id} failed")
        return self.state


class _Clock:
    """A batch's deadline, and how long its initiator polls without sleeping."""

    def __init__(self, timeout_s: float, nbytes: int) -> None:
        now = time.monotonic()
        self.deadline = now + timeout_s
        self.yield_from = now + SPIN_S
        self.spin_until = now + SPIN_S + nbytes / SPIN_FLOOR


def _nothing(_: int) -> None:
    pass


def available() -> bool:
    return importlib.util.find_spec("nixl") is not None


class NixlTransport:
    def __init__(self, own: Mapping | None, timeout_s: float) -> None:
        if not available():
            raise InvalidParameter(f"transfer_engine: 'nixl' needs the nixl package ({INSTALL})")
        own_nixl_logging()
        self.timeout_s = timeout_s
        self.name = f"memcache-{os.getpid()}-{secrets.token_hex(6)}"
        self._agent = make_agent(self.name, progress=False)   # our own requests: we drive them
        self._server: Any = None      # a provider's segment, served by its own agent's progress thread
        self._served: Any = None
        self._lock = threading.Lock()
        self._starts: list[int] = []           # registered local regions, sorted (copy on write)
        self._ends: list[int] = []
        self._handles: dict[tuple[int, int], Any] = {}
        self._peers: dict[bytes, _Peer] = {}    # descriptor -> loaded remote agent
        self._scratch: list[np.ndarray] = []    # free registered header buffers
        self.descriptor = b""
        _live.add(self)
        if own is not None:
            self._serve(own)

    def _serve(self, own: Mapping) -> None:
        """Register the segment with a second agent whose progress thread answers peers. Our own requests
        stay on the first agent, which has no thread: a progress thread on the initiator took 1.6-2x
        the CPU per GB of a READ or WRITE over UCX tcp (benchmarks/README.md, "NIXL alone"). The
        segment is registered with the first agent too (a drain writes from it to peers)."""
        name = self.name + "-serve"
        self._server = make_agent(name, progress=True)
        try:
            self._served = self._server.register_memory([(own.addr, own.size, 0, "")], "DRAM")
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            raise InvalidParameter(f"transfer_engine: NIXL could not register this LocalService's segment: {e}") from e
        if not self.register(own.addr, own.size):
            raise InvalidParameter("transfer_engine: NIXL could not register this LocalService's segment")
        self.descriptor = msgspec.msgpack.encode(
            Descriptor(name, self._server.get_agent_metadata(), own.addr, own.size))

    # ---- local registrations --------------------------------------------------------------------

    def register(self, ptr: int, size: int) -> bool:
        """Register with the agent; a buffer UCX refuses is left to the TCP path (logged, False)."""
        with self._lock:
            if (ptr, size) in self._handles:
                return True
            try:
                self._handles[(ptr, size)] = self._agent.register_memory([(ptr, size, 0, "")], "DRAM")
            except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
                logger.warning("NIXL did not register buffer %#x+%d (it goes through TCP): %s", ptr, size, e)
                return False
            i = bisect.bisect_right(self._starts, ptr)
            self._starts = self._starts[:i] + [ptr] + self._starts[i:]
            self._ends = self._ends[:i] + [ptr + size] + self._ends[i:]
            return True

    def unregister(self, ptr: int, size: int) -> None:
        with self._lock:
            handle = self._handles.pop((ptr, size), None)
            if handle is None:
                return
            i = next(j for j, (s, e) in enumerate(zip(self._starts, self._ends, strict=True))
                     if s == ptr and e == ptr + size)
            self._starts = self._starts[:i] + self._starts[i + 1:]
            self._ends = self._ends[:i] + self._ends[i + 1:]
            self._agent.deregister_memory(handle)

    def covers(self, pieces: list[tuple[int, int]]) -> bool:
        """Every piece lies inside one registered region (NIXL moves nothing else)."""
        starts, ends = self._starts, self._ends
        for ptr, size in pieces:
            i = bisect.bisect_right(starts, ptr) - 1
            if i < 0 or ptr + size > ends[i]:
                return False
        return True

    # ---- transfers ------------------------------------------------------------------------------

    def read(self, seg: SegmentInfo, slices: list[Ranges], landed: Callable[[int], None] = _nothing) -> None:
        """READ the slices, one request each, all in flight at once; ``landed(i)`` runs as soon as slice i
        is done while the later ones keep moving (the reader verifies what landed while it is in cache)."""
        peer = self._pin(seg)
        flights: list[_Flight] = []
        try:
            for ranges in slices:
                flights.append(self._post("READ", seg, ranges, peer))
            clock = _Clock(self.timeout_s, sum(f.nbytes for f in flights))
            for i, f in enumerate(flights):
                self._wait(f, clock)
                landed(i)
        finally:
            self._release(flights)
            self._unpin(peer)

    def write(self, seg: SegmentInfo, ranges: Ranges, steps: list[Callable[[], None]],
              headers: Callable[[], list[tuple[int, bytes]]]) -> None:
        """The payloads in one request; while it moves, ``steps`` run one by one, each followed by a
        progress call (the writer's checksums, read while the transport reads the same bytes); once the
        payloads landed, ``headers()`` in a second request: a valid header always describes a whole
        payload."""
        peer = self._pin(seg)
        try:
            flights = [self._post("WRITE", seg, ranges, peer)]
            try:
                for step in steps:
                    step()
                    flights[0].poll(self._agent)
                self._wait(flights[0], _Clock(self.timeout_s, flights[0].nbytes))
            finally:
                self._release(flights)
            written = headers()
            if written:   # (none: ranges of payloads, the GVA path)
                self._write_headers(seg, written, peer)
        finally:
            self._unpin(peer)

    def _write_headers(self, seg: SegmentInfo, headers: list[tuple[int, bytes]], peer: _Peer) -> None:
        scratch = self._take_scratch(sum(len(h) for _, h in headers))
        flights: list[_Flight] = []
        try:
            pos, out = 0, []
            for off, h in headers:
                scratch[pos:pos + len(h)] = np.frombuffer(h, np.uint8)
                out.append((off, [(scratch.ctypes.data + pos, len(h))]))
                pos += len(h)
            flights.append(self._post("WRITE", seg, out, peer))
            self._wait(flights[0], _Clock(self.timeout_s, 0))
        finally:
            self._release(flights)
            self._give_scratch(scratch)

    def _post(self, op: str, seg: SegmentInfo, ranges: Ranges, peer: _Peer) -> _Flight:
        """One request for the ranges, posted (an empty one is done at once)."""
        d = peer.descriptor
        local, remote = [], []
        for off, pieces in ranges:
            pos = d.base + off
            for ptr, size in pieces:
                local.append((ptr, size, 0))
                remote.append((pos, size, 0))
                pos += size
            if pos > d.base + d.size:
                raise TransferFailed(f"segment {seg.segment_id}: range at {off} ends past the segment")
        flight = _Flight(op, seg.segment_id, sum(size for _, size, _ in local))
        if not local:
            return flight
        a = self._agent
        try:
            flight.handle = a.initialize_xfer(op, a.get_xfer_descs(np.array(local, np.uint64), "DRAM"),
                                              a.get_xfer_descs(np.array(remote, np.uint64), "DRAM"), peer.name)
            flight.state = a.transfer(flight.handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            self._release([flight])
            raise PeerUnavailable(f"NIXL {op} to segment {seg.segment_id} refused: {e}") from e
        return flight

    def _wait(self, flight: _Flight, clock: _Clock) -> None:
        """Drive the request until it is done: poll back to back for ``SPIN_S``, then with a yield (the
        GIL too) between polls while it may still be moving at ``SPIN_FLOOR`` bytes/s, then sleep
        ``SLEEP_S`` between polls; raise at the deadline. A 4 KiB READ over tcp took ~75 us p50 polled
        back to back, ~100 us with yields and ~150 us with sleeps."""
        while flight.poll(self._agent) == "PROC":
            now = time.monotonic()
            if now >= clock.deadline:
                raise TransferFailed(f"NIXL {flight.op} with segment {flight.segment_id} took over "
                                     f"{self.timeout_s} s")
            if now >= clock.spin_until:
                time.sleep(SLEEP_S)
            elif now >= clock.yield_from:
                time.sleep(0)

    def _release(self, flights: list[_Flight]) -> None:
        for f in flights:
            if f.handle is None:
                continue
            try:
                self._agent.release_xfer_handle(f.handle)
            except Exception as e:  # noqa: BLE001 - a request that cannot be cancelled is leaked
                logger.warning("NIXL request to segment %d not released: %s", f.segment_id, e)

    def _pin(self, seg: SegmentInfo) -> _Peer:
        """The segment's remote agent, loaded on first use; held until ``_unpin`` (a peer forgotten
        meanwhile is removed from the agent when its last request ends, never under it)."""
        with self._lock:
            peer = self._peers.get(seg.nixl)
            if peer is None:
                d = checked(seg)
                if d.agent == self.name:
                    raise PeerUnavailable(f"segment {seg.segment_id}: NIXL descriptor names this process's own agent")
                try:
                    name = self._agent.add_remote_agent(d.metadata)
                except Exception as e:  # noqa: BLE001
                    raise PeerUnavailable(f"segment {seg.segment_id}: NIXL metadata refused: {e}") from e
                peer = _Peer(name.decode() if isinstance(name, bytes) else str(name), d)
                self._peers[seg.nixl] = peer
            peer.refs += 1
            return peer

    def _unpin(self, peer: _Peer) -> None:
        with self._lock:
            peer.refs -= 1
            remove = peer.retired and peer.refs == 0
        if remove:
            self._remove(peer)

    def _remove(self, peer: _Peer) -> None:
        try:
            self._agent.remove_remote_agent(peer.name)
        except Exception as e:  # noqa: BLE001
            logger.debug("NIXL remote agent not removed: %s", e)

    def _take_scratch(self, n: int) -> np.ndarray:
        with self._lock:
            if n <= SCRATCH_BYTES and self._scratch:
                return self._scratch.pop()
        buf = np.zeros(max(n, SCRATCH_BYTES), np.uint8)
        self.register(buf.ctypes.data, buf.nbytes)
        return buf

    def _give_scratch(self, buf: np.ndarray) -> None:
        if buf.nbytes == SCRATCH_BYTES:
            with self._lock:
                self._scratch.append(buf)
        else:
            self.unregister(buf.ctypes.data, buf.nbytes)

    def forget(self, seg: SegmentInfo) -> None:
        """The peer left or changed: drop its agent once no request uses it (a restarted peer brings new
        metadata)."""
        with self._lock:
            peer = self._peers.pop(seg.nixl, None)
            if peer is None:
                return
            peer.retired = True
            remove = peer.refs == 0
        if remove:
            self._remove(peer)

    def close(self) -> None:
        """Tear down in a fixed order, never left to the interpreter's exit (which destroys objects in
        no order, UCX's threads still running): the remote agents, the registrations, then our own
        agent, then the serving agent (its progress thread stops with it). Idempotent; also run at
        exit for a transport its LocalService did not close (``_close_live``)."""
        _live.discard(self)
        if self._agent is None:
            return
        with self._lock:
            peers, self._peers = [peer.name for peer in self._peers.values()], {}
            handles, self._handles = list(self._handles.values()), {}
            self._starts, self._ends, self._scratch = [], [], []
        for name in peers:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001, S110 - closing: nothing left to do about it
                pass
        for h in handles:
            try:
                self._agent.deregister_memory(h)
            except Exception:  # noqa: BLE001, S110
                pass
        if self._server is not None:
            try:
                self._server.deregister_memory(self._served)
            except Exception:  # noqa: BLE001, S110
                pass
        # the last references: each agent is destroyed here, in this order, before the segment is unmapped
        self._served = None
        self._agent = None
        self._server = None
        gc.collect()   # a transfer handle caught in a reference cycle (an exception's frame) holds an agent


_live: weakref.WeakSet[NixlTransport] = weakref.WeakSet()   # transports not closed yet


@atexit.register
def _close_live() -> None:
    """At interpreter exit, before modules are torn down: close the transports nobody closed."""
    for t in list(_live):
        try:
            t.close()
        except Exception:  # noqa: BLE001 - exiting: log and go on with the others
            logger.exception("NIXL transport not closed cleanly at exit")
