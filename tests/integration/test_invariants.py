"""The invariant checker: many processes, random traffic, faults injected; zero wrong bytes.

Segment holders and pure clients, over ``host_shm`` and ``host_tcp``, do random batched puts, gets,
exists and removes of 600 keys under eviction pressure (the keys' payloads are ~1.8x the pool); the
TCP writers put two replicas, so objects that lose one are copied again (re-replication). Mid-run
a holder is killed with SIGKILL (and replaced) and the MetaService is killed and restarted. Every
successful get is checked byte for byte by its reader (``chaos_worker.py``), and the test checks that
each payload read was put under that key by some writer. The only passing result is zero wrong bytes.

``MEMCACHE_CHAOS_SECONDS`` sets the run's length (default 40 s; longer runs belong to soak testing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import pytest

from memcache_core import protocol as p
from memcache_core.rpc import expect
from memcache_core.testing import MetaServiceProcess, die_with_parent, running_meta_service, wait_for
from memcache_core.transfer.nixl import available as nixl_available

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "chaos_worker.py")
SECONDS = float(os.environ.get("MEMCACHE_CHAOS_SECONDS", "40"))


class Fleet:
    def __init__(self, ms: MetaServiceProcess, workdir: str, seconds: float) -> None:
        self.ms, self.dir, self.seconds = ms, workdir, seconds
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, **cfg: Any) -> subprocess.Popen[bytes]:
        conf = {"meta_service_url": self.ms.meta_service_url, "config_store_url": self.ms.config_store_url,
                "protocol": "host_shm", "dram_size": "8MB", "client_timeout_seconds": 3,
                "heartbeat_interval_ms": 200, "log_level": "warning", **cfg}
        out = os.path.join(self.dir, name)
        log = open(out + ".log", "wb")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen([sys.executable, WORKER, json.dumps(conf), out, str(self.seconds)],
                                stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
        log.close()
        self.procs.append((name, proc))
        return proc

    def wait(self) -> None:
        for name, proc in self.procs:
            try:
                proc.wait(self.seconds + 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"worker {name} did not finish") from None

    def results(self) -> dict[str, dict]:
        out = {}
        for name, proc in self.procs:
            path = os.path.join(self.dir, name + ".json")
            if proc.returncode == 0:
                assert os.path.exists(path), f"worker {name} left no results: {self.log(name)}"
            if os.path.exists(path):
                with open(path, encoding="ascii") as f:
                    out[name] = json.load(f)
        return out

    def puts(self) -> set[tuple[str, int, int]]:
        done = set()
        for name, _ in self.procs:
            try:
                with open(os.path.join(self.dir, name + ".puts"), encoding="ascii") as f:
                    for line in f:
                        parts = line.split()
                        if len(parts) == 3:
                            done.add((parts[0], int(parts[1]), int(parts[2])))
            except FileNotFoundError:
                pass
        return done

    def log(self, name: str) -> str:
        with open(os.path.join(self.dir, name + ".log"), "rb") as f:
            return f.read()[-3000:].decode(errors="replace")


def check(fleet: Fleet) -> tuple[int, int, list[str]]:
    res = fleet.results()
    wrong = [w for r in res.values() for w in r["wrong"]]
    assert sum(r["wrong_count"] for r in res.values()) == 0, f"wrong bytes returned as hits: {wrong[:10]}"
    puts = fleet.puts()
    never_put = [tuple(t) for r in res.values() for t in r["read"] if tuple(t) not in puts]
    assert never_put == [], f"payloads read that no writer put under that key: {never_put[:10]}"
    return (sum(r["stats"]["verified"] for r in res.values()), sum(r["stats"]["misses"] for r in res.values()),
            sorted(res))


def counter(metrics: str, name: str) -> int:
    return next(int(float(line.split()[-1])) for line in metrics.splitlines() if line.startswith(name + " "))


def test_random_traffic_with_a_member_killed_and_the_meta_service_restarted(capsys):
    with tempfile.TemporaryDirectory(prefix="memcache-chaos-") as d, \
            running_meta_service(heartbeat_timeout_ms=1500, lease_ttl_ms=2000) as ms:
        fleet = Fleet(ms, d, SECONDS)
        victim = fleet.start("holder-shm-1")
        fleet.start("holder-shm-2")
        fleet.start("holder-tcp", protocol="host_tcp", replicas=2)
        fleet.start("client-shm", init_bm=False)
        fleet.start("client-tcp", init_bm=False, protocol="host_tcp", replicas=2)
        t0 = time.monotonic()
        time.sleep(SECONDS / 3)
        victim.kill()
        victim.wait()
        fleet.seconds = SECONDS - (time.monotonic() - t0)
        fleet.start("holder-shm-replacement")
        time.sleep(max(0.0, t0 + 2 * SECONDS / 3 - time.monotonic()))
        repaired = counter(ms.http("/metrics"), "memcache_repaired_objects_total")   # (a restart resets it)
        ms.kill()
        ms.start()
        fleet.wait()
        verified, misses, finished = check(fleet)
        metrics = ms.http("/metrics")
    with capsys.disabled():
        print(f"\ninvariant checker: {verified} verified reads, {misses} misses, 0 wrong bytes "
              f"({len(finished)} workers finished, {SECONDS:g} s, one member killed, MetaService restarted, "
              f"{repaired} replicas made again before the restart)")
    assert "holder-shm-1" not in finished and len(finished) == 5
    assert verified > 1000 and misses > 0      # traffic really ran, and eviction/removal really happened
    assert "memcache_integrity_failures_total 0.0" in metrics
    assert repaired > 0, "no replica was made again: re-replication did not run under this traffic"
    evictions = counter(metrics, "memcache_evictions_total")
    assert evictions > 0, "no eviction happened after the restart: the run had no eviction pressure"


NIXL_SECONDS = min(SECONDS, 20.0)


@pytest.mark.skipif(not nixl_available(), reason="nixl is not installed (pip install --no-deps nixl==1.5.1 "
                                                 "nixl-cu12==1.5.1)")
def test_random_traffic_over_nixl_with_a_member_killed_and_the_meta_service_restarted(capsys, monkeypatch):
    """The same checker with every member on its own host id: gets and puts between segment holders and
    clients cross through NIXL (UCX over tcp on loopback); one client keeps the built-in TCP path to the
    same providers. A holder is killed mid-run, the MetaService restarted."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    with tempfile.TemporaryDirectory(prefix="memcache-chaos-nixl-") as d, \
            running_meta_service(heartbeat_timeout_ms=1500, lease_ttl_ms=2000) as ms:
        fleet = Fleet(ms, d, NIXL_SECONDS)
        nixl = {"transfer_engine": "nixl"}
        victim = fleet.start("holder-1", host_id="h1", **nixl)
        fleet.start("holder-2", host_id="h2", **nixl)
        fleet.start("client-nixl", host_id="h3", init_bm=False, **nixl)
        fleet.start("client-tcp", host_id="h4", init_bm=False)
        t0 = time.monotonic()
        time.sleep(NIXL_SECONDS / 3)
        victim.kill()
        victim.wait()
        fleet.seconds = NIXL_SECONDS - (time.monotonic() - t0)
        fleet.start("holder-replacement", host_id="h5", **nixl)
        time.sleep(max(0.0, t0 + 2 * NIXL_SECONDS / 3 - time.monotonic()))
        ms.kill()
        ms.start()
        fleet.wait()
        verified, misses, finished = check(fleet)
        metrics = ms.http("/metrics")
        nixl_client = fleet.results()["client-nixl"]["paths"]
    with capsys.disabled():
        print(f"\ninvariant checker over NIXL: {verified} verified reads, {misses} misses, 0 wrong bytes "
              f"({len(finished)} workers finished, {NIXL_SECONDS:g} s, one member killed, MetaService restarted)")
    assert "holder-1" not in finished and len(finished) == 4
    assert verified > 200 and misses > 0
    assert nixl_client.get("nixl/read", 0) > 0 and nixl_client.get("nixl/write", 0) > 0, nixl_client
    assert not nixl_client.get("host_tcp/read") and not nixl_client.get("host_tcp/write"), nixl_client
    assert "memcache_integrity_failures_total 0.0" in metrics


def _corrupt_segments(ms: MetaServiceProcess, stop: threading.Event) -> int:
    """Flip random bytes in every segment until stopped (a bad DIMM, a stray write)."""
    client = ms.rpc(3.0)
    rng = np.random.default_rng(7)
    flips = 0
    try:
        while not stop.wait(0.002):
            segs = expect(client.call(p.GetSegments([]), idempotent=True), p.Segments).segments
            for s in segs:
                try:
                    fd = os.open(s.shm_path, os.O_RDWR)
                except FileNotFoundError:   # its owner exited between GetSegments and here
                    continue
                try:
                    off = int(rng.integers(0, s.size))
                    b = os.pread(fd, 1, off)
                    os.pwrite(fd, bytes([b[0] ^ 0x5A]), off)
                    flips += 1
                finally:
                    os.close(fd)
    finally:
        client.close()
    return flips


@pytest.mark.parametrize("checksum", [False, True], ids=["checksums-off", "checksums-on"])
def test_corruption_is_caught_by_the_checker_without_checksums_and_is_a_miss_with_them(checksum, capsys):
    """Negative control for the checker, and the proof of the checksum: bytes are flipped at random in
    the segments while processes read and write. Checksums off: the checker sees wrong bytes (so it
    can fail). Checksums on: zero wrong bytes; the corruptions are misses, counted by the MetaService."""
    seconds = 8.0
    with tempfile.TemporaryDirectory(prefix="memcache-chaos-") as d, \
            running_meta_service(heartbeat_timeout_ms=1500, lease_ttl_ms=2000) as ms:
        fleet = Fleet(ms, d, seconds)
        fleet.start("holder", dram_size="4MB", checksum=checksum)
        fleet.start("client-shm", init_bm=False, checksum=checksum)
        fleet.start("client-tcp", init_bm=False, protocol="host_tcp", checksum=checksum)
        stop = threading.Event()
        flips: list[int] = []
        wait_for(lambda: ms.http("/get_all_keys")["count"] > 0, 10, "the fleet's first objects to corrupt")
        t = threading.Thread(target=lambda: flips.append(_corrupt_segments(ms, stop)))
        t.start()
        fleet.wait()
        stop.set()
        t.join()
        res = fleet.results()
        wrong = sum(r["wrong_count"] for r in res.values())
        metrics = ms.http("/metrics")
    failures = next(int(float(line.split()[-1])) for line in metrics.splitlines()
                    if line.startswith("memcache_integrity_failures_total"))
    with capsys.disabled():
        print(f"\ncorruption run, checksums {'on' if checksum else 'off'}: {flips[0]} bytes flipped, "
              f"{wrong} wrong reads seen by the checker, {failures} integrity failures counted")
    if checksum:
        assert wrong == 0 and failures > 0
    else:
        assert wrong > 0 and failures == 0
