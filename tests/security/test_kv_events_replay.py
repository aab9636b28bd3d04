"""The KV-events replay port against a flood (no CURVE: anyone who reaches the port may ask). Replays
are served on a thread of their own within global bounds (requests and bytes a second) and per-peer
ones (an interval between one peer's replays, one replay at a time), so the live stream is never
kept waiting for them (docs/security.md, "The KV-events replay port")."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import zmq

from memcache_core.testing import free_port, running_meta_service, terminate, wait_for
from memcache_core.testing_kv_events import KVEventSubscriber
from tests.integration.test_kv_events import events_config, joined_store, raw_decode

pytestmark = pytest.mark.integration

# A flood of replay requests ``[b"", 0]`` (the whole kept buffer each) from many DEALER sockets on
# loopback, until stdin closes, MAX requests were sent or SECONDS passed; the odd sockets read and
# discard what comes back (a flooder that reads), the even ones never read. Prints "flooding" once
# every socket sent, then {"sent": n} at the end.
FLOODER = r"""
import json, select, sys, time, zmq
endpoint, n_sockets, seconds, most = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
ctx = zmq.Context()
socks = []
for _ in range(n_sockets):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    socks.append(s)
request = [b"", (0).to_bytes(8, "big")]
sent, announced, deadline = 0, False, time.monotonic() + seconds
while sent < most and time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0)[0]:
    for i, s in enumerate(socks):
        try:
            s.send_multipart(request, zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            pass
        while i % 2 and s.poll(0):
            s.recv_multipart()
    if not announced and sent >= n_sockets:
        print("flooding", flush=True)
        announced = True
    if sent >= most:
        break
print(json.dumps({"sent": sent}), flush=True)
for s in socks:
    s.close()
ctx.term()
"""


class Listener:
    """A live subscriber on a thread of its own: when each key's BlockStored arrived, and every
    sequence number in arrival order."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.arrived: dict[str, float] = {}
        self.seqs: list[int] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(100):
                continue
            _, seq, payload = self.sock.recv_multipart()
            now = time.monotonic()
            with self.lock:
                self.seqs.append(int.from_bytes(seq, "big"))
                for kind, keys, _ in raw_decode(payload):
                    if kind == "BlockStored":
                        for k in keys:
                            self.arrived.setdefault(k, now)
        self.sock.close()

    def seen(self, key: str) -> bool:
        with self.lock:
            return key in self.arrived

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        if not self.thread.is_alive():
            self.ctx.term()


def flood(endpoint: str, sockets: int, seconds: float, most: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", FLOODER, endpoint, str(sockets), str(seconds), str(most)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        ready = select.select([proc.stdout], [], [], 30)[0]
        assert ready and proc.stdout.readline().strip() == b"flooding", "the flooder did not start"
    except BaseException:
        terminate(proc)
        raise
    return proc


def stop_flood(proc: subprocess.Popen[bytes]) -> int:
    """Close the flooder's stdin (``communicate`` does); the number of requests it sent."""
    out, _ = proc.communicate(timeout=30)
    return int(json.loads(out.decode().strip().splitlines()[-1])["sent"])


def replay_from_zero(endpoint: str, replay_endpoint: str, timeout_s: float) -> list[int]:
    honest = KVEventSubscriber(endpoint, raw_decode)
    try:
        return honest.replay(replay_endpoint, 0, timeout_s=timeout_s)
    finally:
        honest.close()


def test_a_flood_of_replay_requests_does_not_silence_the_live_stream():
    """Scenario: before, the one publisher thread answered every waiting replay request between two
    sends, each with the whole kept buffer: 50 sockets sending replay requests stopped the live stream
    (180,650 requests during 1,500 puts: 601 events published, 2,000 dropped, the subscriber got
    nothing for 25 s). Now 50 flooding sockets (half of them reading what comes back) send requests for
    the whole buffer as fast as they can while a writer puts 1,500 objects: the live subscriber gets
    every BlockStored within 3 s of its put, every sequence number in order, nothing dropped; an honest
    replay from 0 asked during the flood comes back whole, and one asked after it too."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    cfg = events_config(kv_events_replay_endpoint=replay)
    endpoint = str(cfg["kv_events_endpoint"])
    with running_meta_service(**cfg) as meta:
        live = Listener(endpoint)
        s = joined_store(meta, dram_size="64MB")
        proc: subprocess.Popen[bytes] | None = None
        try:
            n = [0]

            def subscribed() -> bool:
                key = f"probe-{n[0]}"
                n[0] += 1
                assert s.put(key, b"p") == 0
                return _seen_soon(live, key)
            wait_for(subscribed, 10, "the live subscriber to see a first BlockStored")
            for i in range(300):          # a kept buffer worth replaying before the flood starts
                assert s.put(f"ns@before-{i}", b"b" * 100) == 0

            proc = flood(replay, 50, 120, 5_000_000)
            replayed: dict[str, Any] = {}

            def honest_replay() -> None:
                t = time.monotonic()
                try:
                    replayed["seqs"] = replay_from_zero(endpoint, replay, 20)
                except AssertionError as e:
                    replayed["error"] = str(e)
                replayed["s"] = time.monotonic() - t
            keys = [f"ns@during-{i}" for i in range(1500)]
            put_at: dict[str, float] = {}
            during = threading.Thread(target=honest_replay)
            for i, k in enumerate(keys):
                assert s.put(k, b"d" * 100) == 0
                put_at[k] = time.monotonic()
                if i == 500:
                    during.start()
            during.join(30)

            def all_arrived() -> bool:
                return all(live.seen(k) for k in keys)
            wait_for(all_arrived, 10, lambda: f"every BlockStored of the puts during the flood; "
                     f"{sum(live.seen(k) for k in keys)} of {len(keys)} arrived; "
                     f"status {meta.http('/kv_events/status')}")
            assert proc.poll() is None, "the flood ended before the puts did: the test measured nothing"
            with live.lock:
                late = max(live.arrived[k] - put_at[k] for k in keys)
                seqs = list(live.seqs)
            assert late < 3.0, f"a BlockStored arrived {late:.1f}s after its put"
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "the live stream lost or reordered batches"
            assert "seqs" in replayed, f"the honest replay during the flood: {replayed}"
            assert replayed["seqs"][:1] == [0] and replayed["seqs"] == list(range(len(replayed["seqs"])))
            assert replayed["seqs"][-1] >= 300, replayed["seqs"][-1]   # it had the puts made before the flood
            sent = stop_flood(proc)
            proc = None
            assert sent >= 10_000, f"the flooder sent only {sent} requests"
            print(f"flood: {sent} requests; the latest BlockStored {late:.2f}s after its put; honest replay "
                  f"during it: {len(replayed['seqs'])} batches in {replayed['s']:.2f}s; "
                  f"status {meta.http('/kv_events/status')}")

            # after the flood: an honest replay from 0 has every kept batch
            got = replay_from_zero(endpoint, replay, 20)
            assert got == list(range(len(got))) and got[-1] >= seqs[-1]
            assert meta.metric("kv_events_dropped_total") == 0
        finally:
            if proc is not None:
                terminate(proc)
            s.close()
            live.close()


def _seen_soon(live: Listener, key: str) -> bool:
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        if live.seen(key):
            return True
        time.sleep(0.01)
    return False


def _ask(sock: Any, request: list[bytes], timeout_s: float) -> list[int] | None:
    """Send ``request`` on a DEALER socket; the sequences of the replay, or None if no end came."""
    sock.send_multipart(request)
    seqs: list[int] = []
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        _, seq, _ = sock.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            return seqs
        seqs.append(int.from_bytes(seq, "big"))
    return None


def test_each_peer_gets_one_replay_per_interval_and_bad_requests_are_dropped():
    """Scenario: with kv_events_replay_min_interval_ms at 60 s, a peer (one connection) gets a whole
    replay, and its second request at once is dropped and counted (too_soon), while another peer is
    answered; a malformed request is dropped and counted; a frame over 1 KiB makes ZeroMQ close that
    connection; the port answers honest peers after each."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    cfg = events_config(kv_events_replay_endpoint=replay, kv_events_replay_min_interval_ms=60_000)
    with running_meta_service(**cfg) as meta:
        s = joined_store(meta)
        ctx = zmq.Context()
        peer, bad = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            for i in range(5):
                assert s.put(f"ns@k-{i}", b"k") == 0
            wait_for(lambda: meta.http("/kv_events/status")["last_sequence"] >= 5, 10, "the puts' batches")
            for sock in (peer, bad):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(replay)
            start = [b"", (0).to_bytes(8, "big")]
            first = _ask(peer, start, 10)
            assert first is not None and first == list(range(len(first))) and first[-1] >= 5
            assert _ask(peer, start, 1.0) is None, "a second replay within the peer's interval"

            def dropped(reason: str, n: int) -> bool:
                return meta.http("/kv_events/status")["replay"]["dropped_by_reason"][reason] == n
            wait_for(lambda: dropped("too_soon", 1), 10, "the second request counted as too soon")
            assert replay_from_zero(str(cfg["kv_events_endpoint"]), replay, 10)[-1] >= 5   # another peer

            assert _ask(bad, [b"", b"abc"], 1.0) is None
            wait_for(lambda: dropped("malformed", 1), 10, "the malformed request counted")
            assert _ask(bad, [b"", b"x" * 2048], 1.0) is None      # ZeroMQ closes the connection
            assert replay_from_zero(str(cfg["kv_events_endpoint"]), replay, 10)[-1] >= 5
            assert meta.http("/kv_events/status")["replay"]["served"] == 3
            assert meta.metric("kv_events_replays_total") == 3
            assert meta.metric("kv_events_replay_dropped_total") == 2
        finally:
            peer.close()
            bad.close()
            ctx.term()
            s.close()
