"""The NIXL (UCX) data plane: processes with distinct host ids, so peers are "other hosts" and every
get and put of registered buffers crosses through NIXL; UCX pinned to its tcp transport on loopback."""

from __future__ import annotations

import json
import os
import threading
import urllib.request

import pytest

from memcache_core.transfer.nixl import available
from tests.integration.stores import DSR1_LAYOUT

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not available(), reason="nixl is not installed (pip install --no-deps "
                                                         "nixl==1.5.1 nixl-cu12==1.5.1)")]

UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


@pytest.fixture(autouse=True)
def _ucx_on_loopback(monkeypatch):
    for k, v in UCX_ENV.items():
        monkeypatch.setenv(k, v)


def nixl_store(stores, host: str, **cfg):
    return stores(transfer_engine="nixl", host_id=host, **cfg)


def test_layered_batches_cross_hosts_through_nixl(stores):
    """Scenario: A (host a) writes 16 DeepSeek-shaped blocks into B's segment (host b); C (host c)
    reads them byte-exact; every payload byte moved through NIXL, none through the TCP data server."""
    a, b, c = (nixl_store(stores, h, dram_size="160MB") for h in "abc")
    bid = b("id")["id"]
    keys = [f"nixl-blk-{i}" for i in range(16)]
    assert a("put", keys=keys, layout=DSR1_LAYOUT, preferred=[bid])["codes"] == [0] * 16
    got = c("get", keys=keys, layout=DSR1_LAYOUT)
    assert got["codes"] == [0] * 16 and got["mismatches"] == []
    small = [f"nixl-4k-{i}" for i in range(32)]
    assert c("put", keys=small, layout=[4096])["codes"] == [0] * 32
    for reader in (a, b):
        got = reader("get", keys=small, layout=[1024, 3072])
        assert got["codes"] == [0] * 32 and got["mismatches"] == []
    for proc in (a, c):
        paths = proc("paths")
        assert not paths.get("host_tcp/read") and not paths.get("host_tcp/write"), paths
    assert a("paths")["nixl/write"] >= 16 * sum(DSR1_LAYOUT)
    assert c("paths")["nixl/read"] >= 16 * sum(DSR1_LAYOUT)


@pytest.mark.parametrize("ending", ["close", "stdin closed"])
def test_processes_that_used_nixl_exit_with_status_0(meta, ending):
    """Scenario: a writer and a reader (hosts w and r) move objects of 1 MiB through NIXL (the writer
    puts 4 into the reader's segment and 4 into its own, the reader reads all 8), then end: closed (``close``), or with the store left open for the interpreter's exit. Every read is
    byte-exact and every process exits with status 0; two rounds, four processes, per ending. On a
    host with the RDMA userspace libraries (libibverbs1, ibverbs-providers, libnl), every one of them
    was killed by SIGSEGV at exit: UCX's efa module loaded the host's libnl beside the wheel's."""
    from .stores import StoreProcess

    for rnd in range(2):
        writer = StoreProcess(meta, transfer_engine="nixl", host_id="w", dram_size="16MB")
        reader = StoreProcess(meta, transfer_engine="nixl", host_id="r", dram_size="16MB")
        procs = (writer, reader)
        try:
            there, here = ([f"exit-{ending[0]}-{rnd}-{side}-{i}" for i in range(4)] for side in "rw")
            for keys, seg in ((there, reader), (here, writer)):
                assert writer("put", keys=keys, layout=[1 << 20], preferred=[seg("id")["id"]])["codes"] == [0] * 4
            got = reader("get", keys=there + here, layout=[1 << 20])
            assert got["codes"] == [0] * 8 and got["mismatches"] == []
            assert writer("paths")["nixl/write"] >= 4 << 20 and reader("paths")["nixl/read"] >= 4 << 20
            for p in procs:
                assert p.proc.stdin is not None
                if ending == "close":
                    assert p("close")["rc"] == 0
                p.proc.stdin.close()   # the worker's loop ends: the interpreter exits
            codes = [p.proc.wait(60) for p in procs]
            assert codes == [0, 0], f"round {rnd}: exit statuses {codes} (a negative one is a signal)"
        finally:
            for p in procs:
                p.kill()


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_provider_does_not_spin_a_core(stores, meta):
    """NIXL's Python wrapper starts the progress thread with a zero poll timeout (a core at ~60-85%
    while idle); transfer/nixl.py sets a poll timeout. An idle provider that served NIXL reads and
    writes uses little CPU (its own time, so a busy machine does not inflate it). Measured: ~1% with
    the timeout; with 0, 18% on a machine so loaded that the spinning thread got a fifth of a core."""
    owner, peer = nixl_store(stores, "a"), nixl_store(stores, "b")
    keys = [f"idle-{i}" for i in range(4)]
    assert peer("put", keys=keys, layout=[1 << 20], preferred=[owner("id")["id"]])["codes"] == [0] * 4
    assert peer("get", keys=keys, layout=[1 << 20])["mismatches"] == []
    assert peer("paths")["nixl/read"] >= 4 << 20
    pid = owner.proc.pid
    before, window = _cpu_seconds(pid), 3.0
    threading.Event().wait(window)   # the measuring window itself (nothing to wait for: the provider is idle)
    used = (_cpu_seconds(pid) - before) / window
    assert used < 0.05, f"an idle NIXL provider used {used:.0%} of a core"


def test_owner_killed_mid_transfer_is_a_miss_never_wrong_bytes(stores):
    """Scenario: C reads 16 large objects from B through NIXL while B is killed: each key is either
    byte-exact or a miss, and reads after the kill are misses that return within the client timeout."""
    a, b, c = (nixl_store(stores, h, dram_size="200MB") for h in "abc")
    keys = [f"kill-{i}" for i in range(16)]
    assert a("put", keys=keys, layout=DSR1_LAYOUT, preferred=[b("id")["id"]])["codes"] == [0] * 16
    assert c("get", keys=keys[:1], layout=DSR1_LAYOUT)["codes"] == [0]   # C has loaded B's agent
    assert c.proc.stdin is not None and c.proc.stdout is not None
    c.proc.stdin.write(json.dumps({"op": "get", "keys": keys, "layout": DSR1_LAYOUT}) + "\n")
    c.proc.stdin.flush()
    b.kill()
    got = json.loads(c.proc.stdout.readline())
    assert got["mismatches"] == []
    assert all(code == 0 or code < 0 for code in got["codes"])
    after = c("get", keys=keys, layout=DSR1_LAYOUT)
    assert after["mismatches"] == [] and all(code < 0 for code in after["codes"])
    assert after["seconds"] < 10


def test_owner_killed_mid_put_fails_the_put_never_hangs(stores):
    """Scenario: A writes 16 large objects into B through NIXL while B is killed: each put succeeds or
    fails within the client timeout, and no read of those keys returns wrong bytes."""
    a, b = nixl_store(stores, "a", dram_size="200MB"), nixl_store(stores, "b", dram_size="200MB")
    keys = [f"kill-put-{i}" for i in range(16)]
    bid = b("id")["id"]
    assert a("put", keys=["kill-put-warm"], layout=[4096], preferred=[bid])["codes"] == [0]   # agent loaded
    assert a.proc.stdin is not None and a.proc.stdout is not None
    a.proc.stdin.write(json.dumps({"op": "put", "keys": keys, "layout": DSR1_LAYOUT, "preferred": [bid]}) + "\n")
    a.proc.stdin.flush()
    b.kill()
    put = json.loads(a.proc.stdout.readline())
    assert all(code == 0 or code < 0 for code in put["codes"]) and put["seconds"] < 10
    got = a("get", keys=keys, layout=DSR1_LAYOUT)
    assert got["mismatches"] == [] and all(code == 0 or code < 0 for code in got["codes"])


def _admin_page(meta, path: str) -> str:
    req = urllib.request.Request(meta.metrics_url + path, headers=meta.admin_headers())
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def test_nixl_descriptors_stay_off_the_open_and_admin_views(stores, meta):
    """The agent metadata in SegmentInfo.nixl is a capability to read and write the segment: members get
    it through the authenticated RPC port; /status, the stats API, /metrics and the log never show it."""
    from memcache_core import protocol as p
    from memcache_core.auth import load_secret
    from memcache_core.rpc import RpcClient, expect
    from memcache_core.transfer.nixl_descriptor import descriptor_decoder

    nixl_store(stores, "a")
    nixl_store(stores, "b", init_bm=False)
    client = RpcClient(meta.meta_service_url, 3.0, 0, load_secret(""))
    try:
        segs = expect(client.call(p.GetSegments([]), idempotent=True), p.Segments).segments
    finally:
        client.close()
    (seg,) = segs
    d = descriptor_decoder.decode(seg.nixl)
    assert d.size == seg.size and len(d.metadata) > 64
    views = [_admin_page(meta, path) for path in ("/status", "/api/v1/stats", "/metrics", "/get_all_segments",
                                                  "/api/v1/segments")] + [meta.log_tail(100_000)]
    for text in views:
        assert d.agent not in text and d.metadata.hex()[:32] not in text and str(d.base) not in text


def test_unregistered_buffers_fall_back_to_tcp_registered_ones_use_nixl(stores, meta, monkeypatch):
    """The bytes API copies into internal buffers NIXL does not know: those go through the owner's TCP
    data server; reads into a registered buffer of the same process go through NIXL."""
    import numpy as np

    from memcache_core import DistributedObjectStore

    from .store_worker import pattern

    owner = nixl_store(stores, "a")
    assert owner("put", keys=["fb-0", "fb-1"], layout=[256 << 10])["codes"] == [0, 0]
    store = DistributedObjectStore()
    assert store.setup(meta.local_config(transfer_engine="nixl", host_id="t", client_timeout_seconds=5)) == 0
    assert store.init(0, False) == 0
    try:
        assert store.get("fb-0") == pattern("fb-0", 256 << 10).tobytes()
        paths = _paths(store)
        assert paths.get("host_tcp/read") == 256 << 10 and not paths.get("nixl/read"), paths
        buf = np.zeros(256 << 10, np.uint8)
        assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        assert store.batch_get_into(["fb-1"], [buf.ctypes.data], [buf.nbytes]) == [0]
        assert np.array_equal(buf, pattern("fb-1", 256 << 10))
        assert _paths(store).get("nixl/read") == 256 << 10
    finally:
        store.close()


def _paths(store) -> dict[str, float]:
    reg = store._service().metrics.registry
    return {f"{s.labels['path']}/{s.labels['direction']}": s.value for m in reg.collect()
            if m.name == "memcache_local_transfer_bytes" for s in m.samples if s.name.endswith("_total")}


def test_many_threads_share_one_agent(stores, meta):
    """Engines call one store from several threads: concurrent NIXL requests of one agent (thread-safe
    mode) read and write byte-exact."""
    import numpy as np

    from memcache_core import DistributedObjectStore

    from .store_worker import pattern

    owner = nixl_store(stores, "a", dram_size="64MB")
    keys = [f"mt-{i}" for i in range(16)]
    assert owner("put", keys=keys, layout=[64 << 10] * 4)["codes"] == [0] * 16
    store = DistributedObjectStore()
    assert store.setup(meta.local_config(transfer_engine="nixl", host_id="t", client_timeout_seconds=5)) == 0
    assert store.init(0, False) == 0
    nthreads, size = 4, 256 << 10
    buf = np.zeros(nthreads * 2 * size, np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    failures: list[str] = []

    def work(t: int) -> None:
        mine = buf[t * 2 * size:(t + 1) * 2 * size]
        for r in range(10):
            key = keys[(t * 5 + r) % 16]
            codes = store.batch_get_into([key], [mine.ctypes.data], [size])
            if codes != [0] or not np.array_equal(mine[:size], pattern(key, size)):
                failures.append(f"thread {t} get {key}: {codes}")
            own = f"mt-put-{t}-{r}"
            mine[size:] = pattern(own, size)
            if store.batch_put_from([own], [mine.ctypes.data + size], [size]) != [0]:
                failures.append(f"thread {t} put {own}")
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert failures == []
        got = owner("get", keys=[f"mt-put-{t}-{r}" for t in range(nthreads) for r in range(10)], layout=[size])
        assert got["codes"] == [0] * 40 and got["mismatches"] == []
        assert _paths(store).get("nixl/write") == 40 * size
    finally:
        store.close()


def test_gva_layer_copies_cross_hosts_through_nixl(stores):
    """Scenario: the GVA path across hosts: A (host a) saves blocks layer by layer into P's segment
    (host p), B (host b) loads them layer by layer, byte-exact; the layer copies move through NIXL
    (A's finish reads each object back and writes it whole with its checksum through its own scratch
    buffer, which is not registered: that goes over TCP)."""
    nixl_store(stores, "p", dram_size="64MB")
    a, b = (nixl_store(stores, h, init_bm=False) for h in "ab")
    keys = [f"nixl-gva-{i}" for i in range(4)]
    saved = a("gva_save", keys=keys, layout=DSR1_LAYOUT)
    assert saved["copies"] == [0] * len(DSR1_LAYOUT) and saved["finish"] == [0] * 4
    got = b("gva_load", keys=keys, layout=DSR1_LAYOUT)
    assert got["copies"] == [0] * len(DSR1_LAYOUT) and got["mismatches"] == []
    assert a("paths")["nixl/write"] >= 4 * sum(DSR1_LAYOUT)
    assert b("paths")["nixl/read"] >= 4 * sum(DSR1_LAYOUT) and not b("paths").get("host_tcp/read")
