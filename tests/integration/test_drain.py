"""Graceful drain against real processes: three providers and a reader; one provider is drained
(admin POST, SIGTERM of ``memcache local-service``, ``close()``) while the reader keeps reading."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from typing import Any

import pytest

from memcache_core.testing import MetaServiceProcess, start_local_service, started, wait_for
from tests.integration.stores import StoreProcess

pytestmark = pytest.mark.integration

LAYOUT = [256 << 10] * 4          # 1 MiB objects in 4 pieces
MB_OBJECTS = 24


def post(meta: MetaServiceProcess, path: str) -> Any:
    req = urllib.request.Request(meta.metrics_url + path, method="POST", headers=meta.admin_headers())
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def segments_of(meta: MetaServiceProcess, keys: list[str]) -> dict[str, list[int]]:
    got = meta.http("/batch_query_keys?keys=" + ",".join(keys))
    out = got["keys"] if "keys" in got else [got]     # one key: the /query_key answer
    return {o["key"]: [loc["segment"] for loc in o.get("locations", [])] for o in out}


class Reader(threading.Thread):
    """Reads ``keys`` byte-exact in a loop until stopped; records every round's codes and mismatches."""

    def __init__(self, proc: StoreProcess, keys: list[str]) -> None:
        super().__init__(daemon=True)
        self.proc, self.keys = proc, keys
        self.rounds: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                t0 = time.monotonic()
                got = self.proc("get", keys=self.keys, layout=LAYOUT)
                self.rounds.append({**got, "span": (t0, time.monotonic())})
            except RuntimeError as e:       # the reader process went away (a failed test's teardown)
                self.rounds.append({"codes": [], "mismatches": [str(e)], "span": (0.0, 0.0)})
                return

    def stop(self) -> list[dict[str, Any]]:
        self.halt.set()
        self.join(30)
        return self.rounds


class Provider:
    """``memcache local-service`` in its own process (a standalone memory provider)."""

    def __init__(self, meta: MetaServiceProcess, directory: str, **cfg: Any) -> None:
        conf = {"meta_service_url": meta.meta_service_url, "config_store_url": meta.config_store_url,
                "protocol": "host_shm", "dram_size": "64MB", "heartbeat_interval_ms": 200,
                "client_timeout_seconds": 5, "hcom_url": "tcp://127.0.0.1:0", **cfg}
        self.proc, self.id = start_local_service(conf, directory, lambda: meta.http("/get_all_segments")["segments"],
                                                 name=f"provider-{id(self)}", timeout_s=20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def providers(meta, tmp_path):
    with started(lambda **cfg: Provider(meta, str(tmp_path), **cfg), Provider.stop) as start:
        yield start


def _all_read(rounds: list[dict[str, Any]], during: tuple[float, float]) -> None:
    """Every round hit every key with the right bytes, and some round ran while the drain did."""
    assert any(r["span"][0] < during[1] and r["span"][1] > during[0] for r in rounds), "no read during the drain"
    assert all(r["mismatches"] == [] for r in rounds), "a read returned wrong bytes"
    assert all(set(r["codes"]) == {0} for r in rounds), [r["codes"] for r in rounds if set(r["codes"]) != {0}][:1]


def test_admin_drain_moves_every_object_while_a_reader_reads(meta, stores):
    """Scenario: provider A holds 24 objects; POST /drain/A while a reader reads them in a loop.
    Every read is a hit with the right bytes, A takes no new object from the start, and at the end
    every object lives, byte-exact, in B or C; the drain's state and the metrics count 24 moved."""
    a, b, c = (stores(dram_size="64MB") for _ in range(3))
    a_id = a("id")["id"]
    keys = [f"drain-{i}" for i in range(MB_OBJECTS)]
    assert a("put", keys=keys, layout=LAYOUT, preferred=[a_id])["codes"] == [0] * MB_OBJECTS
    assert all(locs == [a_id] for locs in segments_of(meta, keys).values())
    reader = Reader(stores(init_bm=False), keys)
    reader.start()
    wait_for(lambda: len(reader.rounds) >= 1, 10, "a first round of reads")
    t_post = time.monotonic()
    started = post(meta, f"/drain/{a_id}")
    assert started["success"] and started["state"] == "draining"
    assert a("put", keys=["after-start"], layout=LAYOUT)["codes"] == [0]
    assert segments_of(meta, ["after-start"])["after-start"] != [a_id]     # not on the draining segment
    wait_for(lambda: meta.http(f"/drain/{a_id}")["state"] == "done", 20, "the drain to finish")
    _all_read(reader.stop(), (t_post, time.monotonic()))
    state = meta.http(f"/drain/{a_id}")
    assert (state["moved_objects"], state["dropped_objects"], state["objects_left"]) == (MB_OBJECTS, 0, 0)
    assert state["moved_bytes"] == MB_OBJECTS * sum(LAYOUT)
    assert all(a_id not in locs and len(locs) == 1 for locs in segments_of(meta, keys).values())
    seg = meta.http(f"/query_segment?segment={a_id}")
    assert (seg["draining"], seg["accepts_new_objects"], seg["objects"]) == (True, False, 0)
    got = c("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * MB_OBJECTS and got["mismatches"] == []
    assert f"memcache_drain_moved_objects_total {MB_OBJECTS}" in meta.http("/metrics")
    assert post(meta, "/drain/12345")["success"] is False            # an unknown segment: a clear error
    bad = urllib.request.Request(meta.metrics_url + f"/drain/{a_id}", method="POST")
    with pytest.raises(urllib.error.HTTPError, match="401"):          # admin routes need the token
        urllib.request.urlopen(bad, timeout=5)


def test_sigterm_of_a_provider_drains_it_before_it_exits(meta, stores, providers):
    """Scenario: a standalone provider (``memcache local-service``) holds every object of a pure
    client; it gets SIGTERM while the client reads in a loop. It moves its objects to the two other
    providers and exits 0 once they are moved, before its drain_timeout_ms; no read misses or returns
    wrong bytes."""
    p = providers(drain_timeout_ms=20000)
    client = stores(init_bm=False)
    keys = [f"term-{i}" for i in range(MB_OBJECTS)]
    assert client("put", keys=keys, layout=LAYOUT)["codes"] == [0] * MB_OBJECTS   # the only segment
    b, c = providers(), providers()
    reader = Reader(client, keys)
    reader.start()
    wait_for(lambda: len(reader.rounds) >= 1, 10, "a first round of reads")
    t0 = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    # operations.md: a supervisor waits 1.25 x drain_timeout_ms plus a few seconds before SIGKILL
    assert p.proc.wait(1.25 * 20 + 5) == 0
    took = time.monotonic() - t0
    _all_read(reader.stop(), (t0, t0 + took))
    assert all(locs and locs[0] in (b.id, c.id) for locs in segments_of(meta, keys).values())
    state = meta.http(f"/drain/{p.id}")
    assert (state["reason"], state["moved_objects"], state["dropped_objects"]) == ("owner", MB_OBJECTS, 0)
    # done, not timed_out: every object moved before the drain's deadline (the MetaService ends a drain
    # still planning at its deadline as timed_out), whatever the load made the wall clock read
    assert state["state"] == "done", state


def test_a_drain_rides_out_a_meta_service_restart(meta, stores, providers):
    """Scenario: the MetaService is down when a provider gets SIGTERM; it comes back within the
    provider's drain_timeout_ms. The provider re-joins with its objects, drains them and exits;
    every object is then readable, byte-exact, from the others."""
    p = providers(drain_timeout_ms=20000)
    client = stores(init_bm=False)
    keys = [f"restart-{i}" for i in range(8)]
    assert client("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 8
    b = providers()
    meta.kill()
    p.proc.send_signal(signal.SIGTERM)
    meta.start()
    assert p.proc.wait(20) == 0
    # the client saw the MetaService down; its calls fail fast (-3017) until one gets through again
    wait_for(lambda: client("exist", keys=keys[:1])["codes"] != [-3017], 10, "the client to reach the MetaService")
    got = client("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 8 and got["mismatches"] == []
    assert all(locs == [b.id] for locs in segments_of(meta, keys).values())


def test_drain_of_a_full_pool_drops_and_counts_without_hanging(short_heartbeat, meta, stores):
    """Scenario: B and C are at their high-water mark with objects read after A's were written (none
    colder than A's); A closes with a 20 s drain_timeout_ms. Nothing has room: A's objects are dropped and counted at once (the drain ends ``done``, not ``timed_out``
    waiting for room), they become misses (never wrong bytes), and B's and C's objects are untouched.
    Dropping waits while room may still come, within heartbeat_timeout_ms of the MetaService's start:
    ``short_heartbeat`` makes that 1.5 s."""
    a = stores(dram_size="32MB", drain_timeout_ms=20000)
    b, c = stores(dram_size="16MB"), stores(dram_size="16MB")
    a_id, full = a("id")["id"], {}
    for name, s in (("b", b), ("c", c)):
        full[name] = [f"full-{name}-{i}" for i in range(14)]   # 14 x (1 MiB + header) of 16 MiB: 87.5%
        assert s("put", keys=full[name], layout=LAYOUT, preferred=[s("id")["id"]])["codes"] == [0] * 14
    keys = [f"doomed-{i}" for i in range(20)]
    assert a("put", keys=keys, layout=LAYOUT, preferred=[a_id])["codes"] == [0] * 20
    # B's and C's objects are read after A's were written: hotter, so A's drain may not push them out
    got = b("get", keys=full["b"] + full["c"], layout=LAYOUT)
    assert got["codes"] == [0] * 28 and got["mismatches"] == []
    closed = a("close")
    assert closed["rc"] == 0
    state = meta.http(f"/drain/{a_id}")
    assert (state["moved_objects"], state["dropped_objects"], state["dropped_bytes"]) == (0, 20, 20 * sum(LAYOUT))
    # done: every object was dropped while planning ran; had drops waited for room the drain would
    # have run into its deadline and ended timed_out (no wall-clock bound: load only delays "done")
    assert state["state"] == "done", state
    assert "memcache_drain_dropped_objects_total 20" in meta.http("/metrics")
    got = b("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [-3007] * 20 and got["mismatches"] == []
    got = b("get", keys=full["b"] + full["c"], layout=LAYOUT)
    assert got["codes"] == [0] * 28 and got["mismatches"] == []


def test_a_target_that_stalls_mid_copy_costs_a_retry_elsewhere_never_a_wrong_byte(meta, stores, providers):
    """Scenario: target B is frozen (SIGSTOP) just as provider P starts draining over TCP. The copies
    to B time out (a quarter of P's drain_timeout_ms), B is avoided, and those objects go to C: P
    exits in time and every object is readable, byte-exact, from C."""
    p = providers(drain_timeout_ms=8000, protocol="host_tcp")
    client = stores(init_bm=False)
    keys = [f"stall-{i}" for i in range(8)]
    assert client("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 8
    b, c = providers(), providers()                 # equally empty: B, having joined first, is picked first
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(15) == 0
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    state = meta.http(f"/drain/{p.id}")
    assert state["moved_objects"] + state["dropped_objects"] == 8 and state["failed_moves"] >= 1
    got = client("get", keys=keys, layout=LAYOUT)
    assert got["mismatches"] == []
    on_c = [k for k, locs in segments_of(meta, keys).items() if locs == [c.id]]
    assert [got["codes"][keys.index(k)] for k in on_c] == [0] * len(on_c)
    assert len(on_c) == state["moved_objects"] == 8


def test_an_engine_leaving_a_warm_pool_keeps_its_hot_objects(meta, stores, providers):
    """Scenario: a warm pool. Two providers hold 52 objects each (81% of 64 MB; the high-water mark
    is 90%) written earlier by a client; an engine writes 48 objects into its own segment and reads
    them (the hottest of the pool), then the client reads 4 objects of each provider (hotter still).
    The engine closes with a 20 s drain_timeout_ms: every one of its 48 objects is kept, byte-exact,
    by pushing out colder provider objects, only as many as needed to stay under the high-water
    mark; the 8 hotter ones all stay. (Moving into free room only, it kept 10 of 48.)"""
    provs = [providers(), providers()]
    client = stores(init_bm=False)
    cold = {p.id: [f"cold-{p.id}-{i}" for i in range(52)] for p in provs}
    for pid, keys in cold.items():
        assert client("put", keys=keys, layout=LAYOUT, preferred=[pid])["codes"] == [0] * 52
        assert set(map(tuple, segments_of(meta, keys).values())) == {(pid,)}
    engine = stores(dram_size="64MB", drain_timeout_ms=20000)
    e_id = engine("id")["id"]
    hot = [f"engine-{i}" for i in range(48)]
    assert engine("put", keys=hot, layout=LAYOUT, preferred=[e_id])["codes"] == [0] * 48
    assert all(locs == [e_id] for locs in segments_of(meta, hot).values())
    got = engine("get", keys=hot, layout=LAYOUT)
    assert got["codes"] == [0] * 48 and got["mismatches"] == []
    hotter = [k for keys in cold.values() for k in keys[-4:]]
    got = client("get", keys=hotter, layout=LAYOUT)
    assert got["codes"] == [0] * 8 and got["mismatches"] == []
    assert engine("close")["rc"] == 0
    state = meta.http(f"/drain/{e_id}")
    assert state["state"] == "done", state
    got = client("get", keys=hot, layout=LAYOUT)
    kept = got["codes"].count(0) / len(hot)
    assert got["mismatches"] == [] and kept == 1.0, f"kept {kept:.0%} of the engine's hot objects ({state})"
    assert (state["moved_objects"], state["dropped_objects"]) == (48, 0), state
    got = client("get", keys=hotter, layout=LAYOUT)
    assert got["codes"] == [0] * 8 and got["mismatches"] == [], "a hotter object was pushed out"
    segs = meta.http("/get_all_segments")["segments"]
    assert all(s["used_bytes"] <= 0.9 * s["capacity_bytes"] for s in segs), segs
    left = sum(client("exist", keys=keys)["codes"].count(1) for keys in cold.values())
    # 2 x 57 objects fit under 90% of 64 MB: 104 + 48 - 114 = 38 cold objects pushed out, no more
    assert left == 104 - 38, left
