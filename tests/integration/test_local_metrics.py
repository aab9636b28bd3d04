"""A LocalService's own metrics port: transfer bytes and latency per path, behind the admin token."""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request

import pytest

from memcache_core import DistributedObjectStore
from memcache_core.config import LocalConfig
from memcache_core.errors import ConfigError
from memcache_core.testing import free_port, scrape_metrics, start_local_service, terminate, wait_for
from tests.loops import DATA_SERVER_LOOPS

pytestmark = pytest.mark.integration


def test_transfer_metrics_per_path(meta):
    ports = [free_port(), free_port()]
    a, b = DistributedObjectStore(), DistributedObjectStore()
    assert a.setup(meta.local_config(metrics_port=ports[0])) == 0 and a.init(0, True) == 0
    assert b.setup(meta.local_config(protocol="host_tcp", metrics_port=ports[1])) == 0 and b.init(0, True) == 0
    try:
        assert a.put("m-1", b"a" * 300_000) == 0          # into a's own segment: host_shm
        assert b.get("m-1") == b"a" * 300_000             # b reads a's segment over TCP: host_tcp
        ma, mb = scrape_metrics(ports[0], meta.admin_headers()), scrape_metrics(ports[1], meta.admin_headers())
        wr = 'memcache_local_transfer_bytes_total{direction="write",path="host_shm"}'
        rd = 'memcache_local_transfer_bytes_total{direction="read",path="host_tcp"}'
        assert ma[wr] >= 300_000 and mb[rd] >= 300_000, (ma, mb)
        assert mb['memcache_local_transfer_seconds_count{direction="read",path="host_tcp"}'] >= 1
        assert "memcache_local_meta_restarts_total" in ma
        # label hygiene: no *_created series, the process's own metrics, one spelling per op
        assert not [k for k in (*ma, *mb) if "_created" in k] and ma["process_resident_memory_bytes"] > 0
        text = meta.http("/metrics")
        assert "process_cpu_seconds_total" in text and "_created" not in text
        ops = set(re.findall(r'\bop="([^"]*)"', text))
        assert {"alloc", "commit", "lookup"} <= ops and ops == {o.lower() for o in ops}, ops
        if meta.admin_headers():
            with pytest.raises(urllib.error.HTTPError) as e:
                scrape_metrics(ports[0], {})
            assert e.value.code == 401
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/health", timeout=5) as r:
            assert r.status == 200
    finally:
        a.close()
        b.close()


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("loop", DATA_SERVER_LOOPS)
def test_a_provider_counts_the_bytes_it_served(meta, loop):
    """Scenario: a provider holds 8 MiB that a peer reads over host_tcp; the provider did nothing
    itself, yet its own metrics show the 8 MiB served (and the writes peers made into it), on either
    loop of its data server (the C loop passes its counts on once the connection is quiet)."""
    port = free_port()
    provider, reader = DistributedObjectStore(), DistributedObjectStore()
    assert provider.setup(meta.local_config(metrics_port=port, dram_size="64MB", data_server_loop=loop)) == 0 and provider.init(0, True) == 0
    assert reader.setup(meta.local_config(protocol="host_tcp", dram_size="0")) == 0 and reader.init(0, False) == 0
    try:
        before = scrape_metrics(port, meta.admin_headers())
        rd = 'memcache_local_served_bytes_total{direction="read",path="host_tcp"}'
        wr = 'memcache_local_served_bytes_total{direction="write",path="host_tcp"}'
        assert before[rd] == 0 and before[wr] == 0
        value = bytes(range(256)) * (8 << 12)             # 8 MiB
        assert reader.put("served-1", value) == 0          # the pure client writes into the provider over TCP
        assert reader.get("served-1") == value
        wait_for(lambda: scrape_metrics(port, meta.admin_headers())[rd] >= 8 << 20, 5, "the provider's served reads")
        after = scrape_metrics(port, meta.admin_headers())
        assert after[rd] >= 8 << 20 and after[wr] >= 8 << 20, after
        assert 'memcache_local_transfer_bytes_total{direction="read",path="host_tcp"}' not in after
    finally:
        reader.close()
        provider.close()


def test_a_provider_read_through_shared_memory_counts_it_too(meta, tmp_path):
    """Scenario: a standalone provider (``memcache local-service``) holds 8 MiB that an engine's
    store on the same host writes and reads through shared memory: the provider never touches those
    copies, yet its metrics show them (the reader's heartbeats carry the counts through the
    MetaService), and so do the MetaService's per-segment series."""
    port = free_port()
    conf = {"meta_service_url": meta.meta_service_url, "config_store_url": meta.config_store_url,
            "protocol": "host_shm", "dram_size": "64MB", "heartbeat_interval_ms": 200, "metrics_port": port}
    proc, _ = start_local_service(conf, tmp_path, lambda: meta.http("/get_all_segments")["segments"])
    engine = DistributedObjectStore()
    try:
        assert engine.setup(meta.local_config(dram_size="0", heartbeat_interval_ms=200)) == 0
        assert engine.init(0, False) == 0
        value = bytes(range(256)) * (8 << 12)             # 8 MiB, into the provider: the only segment
        assert engine.put("shm-served", value) == 0 and engine.get("shm-served") == value
        rd = 'memcache_local_served_bytes_total{direction="read",path="host_shm"}'
        wr = 'memcache_local_served_bytes_total{direction="write",path="host_shm"}'
        wait_for(lambda: (m := scrape_metrics(port, meta.admin_headers()))[rd] >= 8 << 20 and m[wr] >= 8 << 20,
                 15, "the provider's metrics to show the 8 MiB read and written through shared memory")
        text = meta.http("/metrics")
        served = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("memcache_segment_served_bytes_total{")]   # the provider's: the only segment
        assert len(served) == 2 and min(served) >= 8 << 20, text
    finally:
        engine.close()
        terminate(proc)


def test_a_named_provider_keeps_its_series_across_restarts(meta):
    """Scenario: a provider with a ``tag`` restarts (a new segment id): its per-segment series keep
    the label ``segment="<tag>"``, so no new series is minted; two LocalServices sharing a tag on one
    host are told apart by their ids instead (never one series for two segments)."""
    def series(text: str) -> set[str]:
        return {m for m in re.findall(r'memcache_segment_used_bytes\{[^}]*segment="([^"]+)"', text)}

    first = DistributedObjectStore()
    assert first.setup(meta.local_config(tag="provider-a")) == 0 and first.init(0, True) == 0
    old_id = first.get_local_service_id()
    assert series(meta.http("/metrics")) == {"provider-a"}
    first.close()
    again, twin = DistributedObjectStore(), DistributedObjectStore()
    try:
        assert again.setup(meta.local_config(tag="provider-a")) == 0 and again.init(0, True) == 0
        assert again.get_local_service_id() != old_id
        assert series(meta.http("/metrics")) == {"provider-a"}
        assert twin.setup(meta.local_config(tag="provider-a")) == 0 and twin.init(0, True) == 0
        assert series(meta.http("/metrics")) == {str(again.get_local_service_id()), str(twin.get_local_service_id())}
    finally:
        again.close()
        twin.close()


def test_each_rank_serves_its_own_metrics_port_and_a_taken_port_never_stops_a_start(meta):
    """Scenario: two TP ranks of one engine get the same config (one metrics_port); each serves on
    metrics_port + rank, and the MetaService lists each segment's metrics address. A third
    LocalService whose port is taken starts all the same, without metrics."""
    base = free_port()
    while not port_is_free(base + 1):
        base = free_port()
    cfg = meta.local_config(metrics_port=base)
    ranks = [DistributedObjectStore(), DistributedObjectStore(), DistributedObjectStore()]
    try:
        for rank, s in enumerate(ranks[:2]):
            assert s.setup(cfg.for_rank(rank)) == 0 and s.init(rank, True) == 0
        assert ranks[2].setup(cfg) == 0 and ranks[2].init(0, True) == 0   # base is rank 0's: a warning only
        for rank in (0, 1):
            assert "memcache_local_meta_restarts_total" in scrape_metrics(base + rank, meta.admin_headers())
        by_id = {g["segment_id"]: g for g in meta.http("/get_all_segments")["segments"]}
        assert [by_id[s.get_local_service_id()]["metrics_addr"] for s in ranks] == \
            [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}", ""]
    finally:
        for s in ranks:
            s.close()


def test_metrics_port_is_validated():
    with pytest.raises(ConfigError, match="metrics_port"):
        LocalConfig(metrics_port=70000)
    with pytest.raises(ConfigError, match="metrics_host"):
        LocalConfig(metrics_port=9000, metrics_host="")
    assert LocalConfig(metrics_port=9000).for_rank(3).metrics_port == 9003
    assert LocalConfig().for_rank(3).metrics_port == 0           # off stays off
    with pytest.raises(ConfigError, match="metrics_port: 65535 \\+ rank 1 is past 65535"):
        LocalConfig(metrics_port=65535).for_rank(1)


def test_a_provider_prints_no_created_families(meta):
    """Scenario: a provider that served reads and writes over host_tcp is scraped. Its text names no
    ``*_created`` family at all: no sample, and no ``# HELP``/``# TYPE`` lines left without one (the
    text format prints each counter's ``_created`` samples as a gauge family of its own)."""
    port = free_port()
    provider, reader = DistributedObjectStore(), DistributedObjectStore()
    assert provider.setup(meta.local_config(metrics_port=port, dram_size="16MB")) == 0 and provider.init(0, True) == 0
    assert reader.setup(meta.local_config(protocol="host_tcp", dram_size="0")) == 0 and reader.init(0, False) == 0
    try:
        assert reader.put("created-1", b"c" * 65536) == 0 and reader.get("created-1") == b"c" * 65536
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=meta.admin_headers())
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
        assert "memcache_local_served_bytes_total" in text and "memcache_local_meta_restarts_total" in text
        assert [line for line in text.splitlines() if "_created" in line] == []
    finally:
        reader.close()
        provider.close()
