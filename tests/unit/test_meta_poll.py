"""The MetaService's serving loop polls on after a request (``poll_spin_us``), but not after
heartbeats alone: 256 members heartbeating once a second would otherwise keep it polling 256 times
a second for requests that a heartbeat never brings (benchmarks/README.md, ``bench_meta_load.py``).

A real ``serve`` loop on a thread, over authenticated sockets; the polls are counted by their
``os.sched_yield`` (the loop yields once per empty poll while it polls on)."""

from __future__ import annotations

import os
import socket
import threading
import time

from memcache_core import protocol as p
from memcache_core.auth import load_secret
from memcache_core.config import MetaConfig
from memcache_core.meta import server
from memcache_core.rpc import RpcClient
from memcache_core.testing import free_port, wait_for


def _listening(url: str) -> bool:
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


SPIN_S = 0.1   # the most poll_spin_us allows


def test_heartbeats_alone_are_not_followed_by_polling(tmp_path, monkeypatch):
    yields = [0]
    real_yield = os.sched_yield

    def counted() -> None:
        yields[0] += 1
        real_yield()
    monkeypatch.setattr(os, "sched_yield", counted)
    url = f"tcp://127.0.0.1:{free_port()}"
    cfg = MetaConfig(meta_service_url=url, config_store_url=f"tcp://127.0.0.1:{free_port()}",
                     metrics_url=f"http://127.0.0.1:{free_port()}", auth_secret_path=str(tmp_path / "secret"),
                     poll_spin_us=int(SPIN_S * 1e6))
    load_secret(cfg.auth_secret_path, create=True)
    stop = threading.Event()
    loop = threading.Thread(target=server.serve, args=(cfg, stop), daemon=True)
    loop.start()
    client = RpcClient(url, timeout_s=10, secret=load_secret(cfg.auth_secret_path))
    try:
        wait_for(lambda: _listening(url), 10, f"the MetaService listening at {url}")
        joined = client.call(p.Join(0, "host-a", os.getpid()))
        assert isinstance(joined, p.Joined)
        beat = p.Heartbeat(joined.client_id, joined.token)

        def heartbeat() -> None:
            reply = client.call(beat)
            assert isinstance(reply, p.HeartbeatReply) and reply.known
        # the Join was a request: the loop polls on for SPIN_S after it; two heartbeats answered
        # after that deadline mean every poll it started before has ended
        end = time.monotonic() + SPIN_S
        wait_for(lambda: time.monotonic() >= end, 10, "the polling after the Join to end", interval_s=SPIN_S / 4)
        for _ in range(2):
            heartbeat()
        before = yields[0]
        for _ in range(50):
            heartbeat()
        assert yields[0] == before, f"the loop polled on after heartbeats alone ({yields[0] - before} polls)"
        # the control: any other request is followed by polling
        assert isinstance(client.call(p.Exist(["k"])), p.Flags)
        wait_for(lambda: yields[0] > before, 10, "the loop polling on after an Exist")
    finally:
        client.close()
        stop.set()
        loop.join(10)
    assert not loop.is_alive()
