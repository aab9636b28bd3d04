"""A frozen peer (SIGSTOP: as a GC pause, a stuck NIC, a VM migration) against real processes: its
connections stay open and nothing moves. A read with another replica to go to waits on it only until
its progress deadline (``read_deadline_ms``, docs/design.md "A frozen peer"); a read of the last copy
waits until the MetaService declares the peer dead, then moves on at once.

Each test resumes what it froze (SIGCONT in ``finally``), so a failure leaves no stopped process.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from memcache_core.testing import MetaServiceProcess, running_meta_service, started, wait_for
from tests.integration.stores import StoreProcess

pytestmark = pytest.mark.integration

LAYOUT = [64 << 10, 16 << 10]
# The documented bound with the defaults is read_deadline_ms (1 s) plus a batch's bytes at 64 MiB/s,
# then the read of the other replica; a loaded CI host gets ample slack, still far below the client
# timeout (what a read waited before the deadline existed).
BOUND_S = 10.0
CLIENT_TIMEOUT_S = 30


def first_holder(ms: MetaServiceProcess, key: str) -> int:
    """The segment a reader tries first for ``key`` (both holders are equally near: the table's order)."""
    return ms.http(f"/query_key?key={key}")["locations"][0]["segment"]


def stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (a signal is delivered to each thread in turn)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):   # a thread that just ended
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s in ("T", "t") for s in states)


@contextlib.contextmanager
def frozen(store: StoreProcess) -> Iterator[None]:
    """``store``'s process stopped (SIGSTOP) for the block, every thread of it; resumed after, always."""
    store.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: stopped(store.proc.pid), 10, "every thread of the provider to stop")
        yield
    finally:
        store.proc.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def pool(heartbeat_timeout_ms: int) -> Iterator[tuple[MetaServiceProcess, Any]]:
    with running_meta_service(heartbeat_timeout_ms=heartbeat_timeout_ms, lease_ttl_ms=2000) as ms:
        with started(lambda **cfg: StoreProcess(ms, **{"protocol": "host_tcp", "dram_size": "32MB",
                                                         "client_timeout_seconds": CLIENT_TIMEOUT_S, **cfg}),
                     StoreProcess.stop) as start:
            yield ms, start


def test_a_frozen_holder_of_one_of_two_replicas_costs_a_reader_at_most_its_deadline():
    """Scenario: replicaNum 2 on two providers, a host_tcp reader. The provider the reader tries first
    for some keys is frozen; the MetaService would declare it dead only after a minute, so only the
    progress deadline can move the reads on. Every get, the first one on the frozen peer and those
    after, returns every key byte-exact from the other replica within the bound."""
    with pool(heartbeat_timeout_ms=60_000) as (ms, start):
        a, b = start(), start()
        reader = start(init_bm=False)
        keys = [f"fz-{i}" for i in range(24)]
        assert reader("put", keys=keys, layout=LAYOUT, replicas=2)["codes"] == [0] * 24
        got = reader("get", keys=keys, layout=LAYOUT)          # connections to both holders are pooled
        assert got["codes"] == [0] * 24 and got["mismatches"] == []
        victim = a if first_holder(ms, keys[0]) == a("id")["id"] else b
        stalled = [k for k in keys if first_holder(ms, k) == victim("id")["id"]]
        assert stalled, "the frozen provider is the first replica of keys[0]"
        with frozen(victim):
            for batch in (stalled, keys, keys):   # the first read on the frozen peer, then the ones after
                got = reader("get", keys=batch, layout=LAYOUT)
                assert got["codes"] == [0] * len(batch) and got["mismatches"] == []
                assert got["seconds"] < BOUND_S, got["seconds"]
        got = reader("get", keys=keys, layout=LAYOUT)          # resumed: both replicas serve again
        assert got["codes"] == [0] * 24 and got["mismatches"] == []


def test_a_read_of_the_last_copy_on_a_frozen_peer_ends_when_the_peer_is_declared_dead():
    """Scenario: replicaNum 1, the holder frozen while a reader reads its objects. With no other copy
    the read waits for the peer (a slow peer is not a dead one), but once the MetaService declares it
    dead (1.5 s of missed heartbeats) the reader learns it from its next heartbeat reply and the
    read ends at once with a miss, long before the client timeout; never with wrong bytes."""
    with pool(heartbeat_timeout_ms=1500) as (ms, start):
        holder = start(dram_size="32MB")
        reader = start(init_bm=False, heartbeat_interval_ms=200)
        keys = [f"last-{i}" for i in range(8)]
        assert reader("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 8
        got = reader("get", keys=keys, layout=LAYOUT)
        assert got["codes"] == [0] * 8 and got["mismatches"] == []
        with frozen(holder):
            got = reader("get", keys=keys, layout=LAYOUT)
        assert all(c != 0 for c in got["codes"]) and got["mismatches"] == [], got
        assert got["seconds"] < CLIENT_TIMEOUT_S / 2, got["seconds"]
