"""HA MetaService against a real etcd and real processes: three MetaServices, two LocalServices doing
continuous verified puts and gets; the leader killed, paused, and etcd itself restarted.

Every get is byte-exact-checked by the worker; every put that returned success must be readable,
byte-exact, at the end (the objects live in the LocalServices' segments: a new leader learns them
back from the members' re-join reports).
"""

from __future__ import annotations

import collections
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.auth import load_secret
from memcache_core.rpc import RpcClient
from memcache_core.testing import MetaServiceProcess, wait_for
from memcache_core.testing_etcd import EtcdProcess
from tests.integration.stores import StoreProcess

pytestmark = pytest.mark.integration

TTL_S = 2
LAYOUT = [1024] * 4
# What a put or get may answer while the MetaService fails over or etcd is away: misses and clear
# "not reachable / not leader / re-joining" codes, and out-of-memory while the re-joined segments
# wait out their grace before taking new objects. Never wrong bytes (checked separately).
FAILOVER_CODES = {errors.META_NOT_CONNECTED, errors.NOT_LEADER, errors.CLIENT_NOT_INITIALIZED,
                  errors.OBJECT_NOT_EXISTS, errors.STATE_MISMATCH, errors.ERROR, errors.WRITE_IN_PROGRESS,
                  errors.OUT_OF_MEMORY}


class Pool:
    def __init__(self, d: str, **overrides: Any) -> None:
        """Three HA MetaServices on a fresh etcd; ``overrides``: more MetaConfig settings for each."""
        self.etcd = EtcdProcess(d).start()
        self.cluster = f"t{random.getrandbits(32):x}"
        self.metas = [MetaServiceProcess(d, ha_enable=True, ha_etcd_endpoints=self.etcd.endpoint,
                                         ha_cluster_id=self.cluster, ha_lease_ttl_ms=TTL_S * 1000,
                                         heartbeat_timeout_ms=3000, lease_ttl_ms=2000, **overrides).start()
                      for _ in range(3)]
        self.stores: list[StoreProcess] = []

    @property
    def url_list(self) -> str:
        return ",".join(m.meta_service_url for m in self.metas)

    @property
    def etcd_url(self) -> str:
        return f"etcd://127.0.0.1:{self.etcd.port}/{self.cluster}"

    def leaders(self, metas: list[MetaServiceProcess] | None = None) -> list[MetaServiceProcess]:
        out = []
        for m in metas or self.metas:
            try:
                if m.proc is not None and m.http("/leader")["role"] == "leader":
                    out.append(m)
            except OSError:
                pass
        return out

    def leader(self, timeout_s: float = 10.0, among: list[MetaServiceProcess] | None = None) -> MetaServiceProcess:
        wait_for(lambda: len(self.leaders(among)) == 1, timeout_s, "exactly one HA leader")
        return self.leaders(among)[0]

    def store(self, url: str, **cfg: Any) -> StoreProcess:
        s = StoreProcess(self.metas[0], meta_service_url=url, client_timeout_seconds=2, heartbeat_interval_ms=200,
                         dram_size="64MB", **cfg)
        self.stores.append(s)
        return s

    def close(self) -> None:
        for s in self.stores:
            s.stop()
        for m in self.metas:
            if m.proc is not None and m.proc.poll() is None:
                os.kill(m.proc.pid, signal.SIGCONT)
            m.stop()
        self.etcd.stop()


class Traffic(threading.Thread):
    """Continuous puts of new keys and verified gets of keys already stored, from one store."""

    def __init__(self, store: StoreProcess, name: str) -> None:
        super().__init__(daemon=True)
        self.store, self.name = store, name
        self.stored: list[str] = []
        self.codes: collections.Counter[int] = collections.Counter()
        self.wrong: list[str] = []
        self.last_put_ok = 0.0   # when the last put that succeeded was *sent* (not when it returned)
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            i = 0
            while not self.halt.is_set():
                keys = [f"{self.name}-{i}-{j}" for j in range(4)]
                i += 1
                sent = time.monotonic()
                codes = self.store("put", keys=keys, layout=LAYOUT)["codes"]
                self.codes.update(codes)
                if any(c == 0 for c in codes):
                    self.stored += [k for k, c in zip(keys, codes, strict=True) if c == 0]
                    self.last_put_ok = sent
                if self.stored:
                    got = self.store("get", keys=random.sample(self.stored, min(4, len(self.stored))), layout=LAYOUT)
                    self.codes.update(got["codes"])
                    self.wrong += got["mismatches"]
                self.halt.wait(0.01)   # pace: a few hundred objects a second, far below the pool's size
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def resumed_since(self, t: float) -> bool:
        """A put sent after ``t`` succeeded: after a failover, this member re-joined the new leader
        (and reported its objects). A put sent before the kill that returned after it says nothing:
        it was committed by the old leader, and the member may not have re-joined yet (its objects
        are misses until it does)."""
        return self.last_put_ok > t

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        assert self.error is None, self.error
        assert not self.wrong, f"wrong bytes read: {self.wrong[:5]}"
        assert set(self.codes) <= {0} | FAILOVER_CODES, self.codes


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    monkeypatch.setenv("MEMCACHE_TEST_STORE_LOG_LEVEL", "INFO")   # (in the output of a failure)
    with tempfile.TemporaryDirectory(prefix="memcache-ha-") as d:
        pl = Pool(d)
        try:
            yield pl
        finally:
            pl.close()


def start_traffic(pool: Pool) -> tuple[StoreProcess, StoreProcess, list[Traffic]]:
    a = pool.store(pool.url_list)          # a list of URLs, tried in turn
    b = pool.store(pool.etcd_url)          # follows the leader key in etcd
    traffic = [Traffic(a, "a"), Traffic(b, "b")]
    for t in traffic:
        t.start()
    wait_for(lambda: all(len(t.stored) >= 20 for t in traffic), 20, "puts before the failure")
    return a, b, traffic


def verify_all(stores: list[StoreProcess], traffic: list[Traffic], pool: Pool) -> None:
    keys = [k for t in traffic for k in t.stored]
    for s in stores:
        for i in range(0, len(keys), 64):
            got = s("get", keys=keys[i:i + 64], layout=LAYOUT)
            assert got["mismatches"] == []
            lost = [(k, c) for k, c in zip(keys[i:i + 64], got["codes"], strict=True) if c != 0]
            assert not lost, (f"{len(lost)} objects whose put succeeded are not readable: {lost[:5]}\n"
                              f"{what_the_pool_says(pool, [k for k, _ in lost[:3]])}")


def what_the_pool_says(pool: Pool, keys: list[str]) -> str:
    """For a failure's message: the leader's view of ``keys`` and its segments, and every
    MetaService's log of elections and joins (the test's directory is gone once it has failed)."""
    out = []
    for m in pool.leaders():
        for path in (f"/batch_query_keys?keys={','.join(keys)}", "/get_all_segments"):
            try:
                out.append(f"leader {m.meta_service_url} {path}: {m.http(path)}")
            except OSError as e:
                out.append(f"leader {m.meta_service_url} {path}: {e}")
    for m in pool.metas:
        with open(m.log_path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if any(w in ln for w in ("join", "leader", "dead", "WARN", "ERROR"))]
        out.append(f"--- {m.meta_service_url}:\n" + "\n".join(lines[-40:]))
    return "\n".join(out)


def test_kill9_of_the_leader_fails_over_and_loses_nothing(pool):
    leader = pool.leader()
    a, b, traffic = start_traffic(pool)
    t_kill = time.monotonic()
    leader.kill()
    t_dead = time.monotonic()   # (kill waits for the process to be gone)
    rest = [m for m in pool.metas if m is not leader]
    # operations.md: the dead leader's lease lapses at most the TTL after its last renewal, and a
    # standby wins within a fraction of a second of that. The margin (TTL_S more) is for this test's
    # own view on a loaded machine: the standby's watch and this test's /role polls are stalled too.
    bound = TTL_S + 1 + TTL_S
    new = pool.leader(bound + 1, rest)
    took = time.monotonic() - t_kill
    print(f"a standby led {took:.2f} s after kill -9 of the leader (lease TTL {TTL_S} s)")
    assert took <= bound, f"a standby led only after {took:.2f}s"
    wait_for(lambda: all(t.resumed_since(t_dead) for t in traffic), 15, "both clients to put again")
    for t in traffic:
        t.stop()
    verify_all([a, b], traffic, pool)
    assert new.http("/leader")["leader"]["control"] == new.meta_service_url
    metrics = new.http("/metrics")
    assert "memcache_meta_is_leader 1" in metrics
    assert f"memcache_meta_term {new.http('/leader')['term']}" in metrics


def test_paused_leader_never_serves_after_it_wakes(pool):
    leader = pool.leader()
    pinned = pool.store(leader.meta_service_url, init_bm=False)   # talks to this MetaService only
    a, b, traffic = start_traffic(pool)
    assert pinned("put", keys=["pinned-0"], layout=LAYOUT)["codes"] == [0]
    t_stop = time.monotonic()
    os.kill(leader.pid, signal.SIGSTOP)
    rest = [m for m in pool.metas if m is not leader]
    pool.leader(TTL_S + 3, rest)
    wait_for(lambda: time.monotonic() - t_stop >= 2 * TTL_S, 3 * TTL_S, "twice the lease TTL")
    wait_for(lambda: all(t.resumed_since(t_stop) for t in traffic), 15, "both clients to put again")
    os.kill(leader.pid, signal.SIGCONT)
    # At once after waking, before its election thread has run: no put or alloc goes through it.
    codes = pinned("put", keys=["pinned-1", "pinned-2"], layout=LAYOUT)["codes"]
    assert set(codes) <= {errors.NOT_LEADER, errors.META_NOT_CONNECTED}, codes
    rpc = RpcClient(leader.meta_service_url, 2.0, secret=load_secret(""))
    try:
        with pytest.raises(errors.NotLeader):
            rpc.call(p.Join(0, "host", os.getpid()))
        with pytest.raises(errors.NotLeader):
            rpc.call(p.Alloc(1, b"x" * 16, ["k"], [64]))
    finally:
        rpc.close()
    got = pinned("get", keys=["pinned-0"], layout=LAYOUT)
    assert got["mismatches"] == [] and got["codes"][0] in {0} | FAILOVER_CODES
    wait_for(lambda: leader.http("/leader")["role"] == "standby", 5, "the woken leader to stand by")
    assert "memcache_meta_is_leader 0" in leader.http("/metrics")
    assert len(pool.leaders()) == 1
    for t in traffic:
        t.stop()
    verify_all([a, b], traffic, pool)


def test_etcd_restart_degrades_with_clear_codes_and_recovers(pool):
    pool.leader()
    a, b, traffic = start_traffic(pool)
    pool.etcd.stop()
    wait_for(lambda: not pool.leaders(), 3 * TTL_S, "the leader to stop serving without etcd")
    t_back = time.monotonic()
    pool.etcd.start()
    pool.leader(3 * TTL_S)
    wait_for(lambda: all(t.resumed_since(t_back) for t in traffic), 20, "both clients to put again")
    for t in traffic:
        t.stop()
    verify_all([a, b], traffic, pool)


def test_config_store_survives_failover(pool):
    leader = pool.leader()
    rpc = RpcClient(pool.url_list, 2.0, secret=load_secret(""))
    try:
        rpc.call(p.ConfigPut("engine/addr", b"10.0.0.1:9000"))
        leader.kill()
        pool.leader(TTL_S + 3, [m for m in pool.metas if m is not leader])
        wait_for(lambda: _config_get(rpc, "engine/addr") == b"10.0.0.1:9000", 10, "the config value back")
        assert rpc.max_term > 0
    finally:
        rpc.close()


def _config_get(rpc: RpcClient, key: str) -> bytes | None:
    try:
        reply = rpc.call(p.ConfigGet(key))
    except errors.MetaServiceUnavailable:
        return None
    assert isinstance(reply, p.Value)
    return reply.value
