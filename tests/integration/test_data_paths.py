"""Bytes written by one process are read byte-exact by others, over host_shm and host_tcp."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from memcache_core import DistributedObjectStore
from memcache_core.testing import start_local_service
from memcache_core.transfer.nixl import available as nixl_available
from tests.integration.stores import DSR1_LAYOUT

from .store_worker import pattern

pytestmark = pytest.mark.integration


NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl is not installed"))


def _path(protocol: str, host: str, env: pytest.MonkeyPatch) -> dict:
    """``nixl``: each process on its own host id (peers are other hosts), UCX over tcp on loopback."""
    if protocol == "host_tcp-python":   # the data servers' Python loop (host_tcp: the C one where built)
        return {"protocol": "host_tcp", "data_server_loop": "python"}
    if protocol != "nixl":
        return {"protocol": protocol}
    env.setenv("UCX_TLS", "tcp")
    env.setenv("UCX_NET_DEVICES", "lo")
    return {"protocol": "host_shm", "transfer_engine": "nixl", "host_id": host}


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp", "host_tcp-python", NIXL])
def test_layered_batches_between_three_processes(stores, protocol, monkeypatch):
    """Scenario: A writes 32 DeepSeek-shaped blocks of 122 pieces; B and C read every one byte-exact."""
    a, b, c = (stores(**_path(protocol, h, monkeypatch), dram_size="160MB") for h in "abc")
    keys = [f"{protocol}-blk-{i}" for i in range(32)]
    assert a("put", keys=keys[:16], layout=DSR1_LAYOUT)["codes"] == [0] * 16
    assert b("put", keys=keys[16:], layout=DSR1_LAYOUT)["codes"] == [0] * 16
    for reader in (b, c):
        got = reader("get", keys=keys, layout=DSR1_LAYOUT)
        assert got["codes"] == [0] * 32
        assert got["mismatches"] == []
    assert c("exist", keys=keys + ["absent"])["codes"] == [1] * 32 + [0]


@pytest.mark.parametrize("protocol", ["host_shm", "host_tcp", "host_tcp-python", NIXL])
def test_contiguous_objects_and_same_layout_reads(stores, protocol, monkeypatch):
    a, b = stores(**_path(protocol, "a", monkeypatch)), stores(**_path(protocol, "b", monkeypatch))
    keys = [f"c-{i}" for i in range(8)]
    assert a("put", keys=keys, layout=[8784 << 10])["codes"] == [0] * 8
    got = b("get", keys=keys, layout=[8784 << 10])
    assert got["codes"] == [0] * 8 and got["mismatches"] == []
    # the same object read with a different piece layout of the same total size
    got = b("get", keys=keys, layout=[4392 << 10, 4392 << 10])
    assert got["codes"] == [0] * 8 and got["mismatches"] == []


def test_put_existing_key_is_a_noop_success(stores):
    a, b = stores(), stores()
    assert a("put", keys=["dup"], layout=[4096])["codes"] == [0]
    assert b("put", keys=["dup", "dup"], layout=[4096])["codes"] == [0, 0]
    assert b("get", keys=["dup"], layout=[4096])["mismatches"] == []


def test_one_store_many_threads(meta):
    """Scenario: SGLang's prefetch, backup and scheduler threads share one store object."""
    store = DistributedObjectStore()
    assert store.setup(meta.local_config(dram_size="128MB")) == 0
    assert store.init(0, True) == 0
    size, per_thread, nthreads = 256 << 10, 24, 6
    buf = np.zeros(size * per_thread * nthreads * 2, np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    errors: list[str] = []

    def work(t: int) -> None:
        base = t * per_thread * 2 * size
        keys = [f"t{t}-{i}" for i in range(per_thread)]
        for i, k in enumerate(keys):
            buf[base + i * size: base + (i + 1) * size] = pattern(k, size)
        src = [buf.ctypes.data + base + i * size for i in range(per_thread)]
        dst_off = base + per_thread * size
        dst = [buf.ctypes.data + dst_off + i * size for i in range(per_thread)]
        for _ in range(3):
            if store.batch_put_from(keys, src, [size] * per_thread) != [0] * per_thread:
                errors.append(f"put failed in thread {t}")
            if store.batch_get_into(keys, dst, [size] * per_thread) != [0] * per_thread:
                errors.append(f"get failed in thread {t}")
            for i, k in enumerate(keys):
                if not np.array_equal(buf[dst_off + i * size: dst_off + (i + 1) * size], pattern(k, size)):
                    errors.append(f"mismatch {k}")
    threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    store.close()
    assert errors == []


def test_bytes_api_and_key_info(meta):
    s = DistributedObjectStore()
    assert s.setup(meta.local_config()) == 0 and s.init(0, True) == 0
    payload = bytes(range(256)) * 100
    assert s.put("bytes-key", payload) == 0
    assert s.get("bytes-key") == payload
    assert s.get("nope") == b""
    assert s.put_batch(["b1", "b2"], [b"one", bytearray(b"two")]) == 0
    assert s.get_batch(["b1", "b2", "b3"]) == [b"one", b"two", b""]
    # one Lookup tells a bytes get both the size and the places: the MetaService counts each key once
    before = meta.metric("gets_total")
    assert s.get_batch(["b1", "b2", "b3"]) == [b"one", b"two", b""] and s.get("bytes-key") == payload
    assert meta.metric("gets_total") - before == 4
    other = DistributedObjectStore()   # a reader in another process's place: a pure client over TCP
    assert other.setup(meta.local_config(protocol="host_tcp", dram_size="0")) == 0 and other.init(0, False) == 0
    assert other.get_batch(["b2", "bytes-key", "b3"]) == [b"two", payload, b""]
    other.close()
    info = s.get_key_info("bytes-key")
    assert info.size() == len(payload) and len(info.loc_list()) == 1
    assert s.batch_get_key_info(["nope"])[0].size() == 0
    assert s.remove("b1") == 0 and s.is_exist("b1") == 0
    assert s.remove("b1") == -3007
    assert s.remove_batch(["b2", "b2"]) == [0, -3007]
    assert s.remove_all() == 0 and s.is_exist("bytes-key") == 0
    s.close()


def test_pure_client_writes_into_a_standalone_local_service(meta, tmp_path):
    """Scenario: a memory provider process holds the pool; engines come and go as pure clients."""
    provider, _ = start_local_service({"meta_service_url": meta.meta_service_url, "protocol": "host_shm",
                                       "dram_size": "64MB", "heartbeat_interval_ms": 200}, tmp_path,
                                      lambda: meta.http("/get_all_segments")["segments"])
    try:
        for i in range(2):
            c = DistributedObjectStore()
            assert c.setup(meta.local_config()) == 0 and c.init(0, init_bm=False) == 0
            if i == 0:
                assert c.put("survives", b"x" * 10000) == 0
            else:
                assert c.get("survives") == b"x" * 10000
            c.close()
    finally:
        provider.terminate()
        assert provider.wait(10) == 0
