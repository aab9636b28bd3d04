"""A LocalService's metrics port (``metrics_port``) against connections that never send a request:
a real listen backlog, a bounded number of handler threads before any token is checked, and an
honest scrape answered while they stay open."""

from __future__ import annotations

import contextlib
import socket

import pytest

from memcache_core.local.metrics import MAX_CONNECTIONS
from memcache_core.testing import free_port, scrape_metrics, wait_for

pytestmark = pytest.mark.integration

IDLE = 400


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_idle_connections_to_the_metrics_port_cost_a_bounded_number_of_threads(meta, stores):
    """Scenario: before, the metrics port had a backlog of 5 and started a thread for every connection
    before reading its token: 400 idle connections were 400 threads. Now at most MAX_CONNECTIONS (64)
    handler threads exist whatever connects, and a scrape with the admin token is answered while the
    400 connections are still open (the oldest one still sending its headers makes room)."""
    port = free_port()
    store = stores(metrics_port=port)
    pid = store.proc.pid
    assert "memcache_local_meta_restarts_total" in scrape_metrics(port, meta.admin_headers())
    before = _threads(pid)
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        # every connection is accepted or queued in the backlog; the threads settle at the bound
        wait_for(lambda: _threads(pid) >= before + MAX_CONNECTIONS // 2, 20, "the metrics port serving the idle connections")
        assert "memcache_local_meta_restarts_total" in scrape_metrics(port, meta.admin_headers())
        peak = _threads(pid)
        print(f"{IDLE} idle connections: {before} threads before, {peak} with them")
        assert peak <= before + MAX_CONNECTIONS + 4, f"{peak - before} threads for {IDLE} idle connections"
    finally:
        for s in idle:
            with contextlib.suppress(OSError):
                s.close()
    assert store("exist", keys=["nothing"])["codes"] == [0]   # the LocalService itself carried on
