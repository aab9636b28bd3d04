"""``--hicache-storage-backend npu_memcache`` (our NpuMemcacheStore) against a real SGLang server.

One MetaService and one server (A) serve the whole module; the two-server test adds B for its
own duration. The MetaService-failure test runs last because it restarts the MetaService.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    ADMIN,
    ADMIN_KEY,
    FULL_PAGES,
    assert_a_fresh_server_restores,
    flush,
    generate,
    generate_from_storage,
    pool_keys,
    prompt,
    request,
    start,
    wait_for_new_keys,
)
from memcache_sglang import testing as harness

from memcache_core.testing import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

# Short client timeout so a dead MetaService costs seconds, not the 60 s default. The MetaService's
# HTTP admin address given to the backend is unreachable: nothing the backend does may depend on it
# (clear() once fell back to wiping the whole pool when it could not list keys there).
UNREACHABLE_ADMIN_URL = "http://127.0.0.1:9"
EXTRA = {"client_timeout_seconds": 5, "metrics_url": UNREACHABLE_ADMIN_URL}


@pytest.fixture(scope="module")
def server_a(meta: harness.MetaHandle, model: str, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[harness.ServerHandle]:
    server = start(meta, model, tmp_path_factory.mktemp("logs"), "server_a", extra_config=EXTRA,
                   extra_args=["--enable-metrics", "--admin-api-key", ADMIN_KEY])
    try:
        yield server
    finally:
        server.stop()


def write_through(server: harness.ServerHandle, meta: harness.MetaHandle, ids: list[int]
                  ) -> tuple[dict, set[str]]:
    """First (cold) request; returns it and the objects its write-through put in the pool."""
    before = pool_keys(meta)
    cold = generate(server, ids)
    assert cold["device"] == cold["host"] == cold["storage"] == 0, cold
    return cold, wait_for_new_keys(meta, before, FULL_PAGES)


def storage_pages(server: harness.ServerHandle) -> tuple[float, float]:
    """Pages backed up and prefetched, from SGLang's histograms fed by ``get_stats()``."""
    text = request(server, "GET", "/metrics", idempotent=True, timeout=30).text
    sums = {"backup": 0.0, "prefetch": 0.0}
    for line in text.splitlines():
        for kind in sums:
            if line.startswith(f"sglang:{kind}_pgs_sum"):
                sums[kind] += float(line.rsplit(" ", 1)[1])
    return sums["backup"], sums["prefetch"]


def test_l3_restore_after_flush(server_a: harness.ServerHandle, meta: harness.MetaHandle) -> None:
    """Scenario: cold -> device hit -> /flush_cache -> restored from L3 (same text) -> device hit;
    the backend's StorageMetrics reach SGLang's /metrics."""
    ids = prompt(1)
    backup0, prefetch0 = storage_pages(server_a)
    cold, written = write_through(server_a, meta, ids)
    assert all(k.startswith("sgl1.") for k in written), sorted(written)[:3]

    warm = generate(server_a, ids)
    assert warm["device"] >= (FULL_PAGES - 1) * 128 and warm["storage"] == 0, warm
    assert warm["text"] == cold["text"]

    flush(server_a)
    restored = generate_from_storage(server_a, ids)
    assert restored["backend"] == "NpuMemcacheStore", restored
    assert restored["text"] == cold["text"]

    again = generate(server_a, ids)
    assert again["device"] >= restored["storage"] and again["storage"] == 0, again
    assert again["text"] == cold["text"]

    def counted() -> bool:
        backup, prefetch = storage_pages(server_a)
        return backup - backup0 >= FULL_PAGES and prefetch - prefetch0 >= FULL_PAGES - 1

    wait_for(counted, 30, lambda: f"the pages counted as backed up and prefetched: {storage_pages(server_a)}",
             interval_s=0.5)


def test_restore_uses_the_stored_bytes(server_a: harness.ServerHandle, meta: harness.MetaHandle) -> None:
    """Scenario: the pool's objects are replaced by same-size garbage -> the restored text changes.

    Proves the restore comparison can fail: a backend that reported hits without delivering the
    written bytes would not pass the other tests.
    """
    from memcache_core import DistributedObjectStore

    ids = prompt(2)
    cold, written = write_through(server_a, meta, ids)
    client = DistributedObjectStore()
    assert client.setup(meta_local_config(meta)) == 0 and client.init(0, True) == 0
    try:
        sizes = {key: client.get_key_info(key).size() for key in sorted(written)}
        assert all(size > 0 for size in sizes.values()), sizes
        assert client.remove_batch(list(sizes)) == [0] * len(sizes)   # one wait for the owners, not one per key
        for key, size in sizes.items():
            assert client.put(key, os.urandom(size)) == 0
        flush(server_a)
        restored = generate(server_a, ids)
        assert restored["storage"] >= (FULL_PAGES - 1) * 128, restored
        assert restored["text"] != cold["text"], "garbage KV produced the same text: the check is blind"
    finally:
        client.remove_batch(sorted(written))
        client.close()


def meta_local_config(meta: harness.MetaHandle):  # noqa: ANN201
    from memcache_core import LocalConfig

    cfg = LocalConfig()
    cfg.meta_service_url = meta.meta_service_url
    cfg.config_store_url = meta.config_store_url
    cfg.protocol = "host_shm"
    cfg.dram_size = "64MB"
    return cfg


def test_clear_empties_this_servers_namespace(server_a: harness.ServerHandle,
                                              meta: harness.MetaHandle) -> None:
    """Scenario: POST /hicache/storage-backend/clear on a server whose admin URL is unreachable ->
    its own namespace is emptied (no storage hit after), another tenant's object survives."""
    from memcache_core import DistributedObjectStore

    client = DistributedObjectStore()
    assert client.setup(meta_local_config(meta)) == 0 and client.init(0, True) == 0
    foreign = "other-model:sgl1.0123456789abcdef." + "ab" * 32 + ".r0p0c0"
    try:
        assert client.put(foreign, b"x" * 4096) == 0
        ids = prompt(3)
        cold, _ = write_through(server_a, meta, ids)
        assert server_a.extra_config["metrics_url"] == UNREACHABLE_ADMIN_URL
        r = request(server_a, "POST", "/hicache/storage-backend/clear", idempotent=True, headers=ADMIN)
        assert r.status_code == 200, r.text
        left = pool_keys(meta)
        assert left == {foreign}, sorted(left)[:5]
        flush(server_a)
        after = generate(server_a, ids)
        assert after["storage"] == 0 and after["device"] == 0 and after["host"] == 0, after
        assert after["text"] == cold["text"]
    finally:
        client.remove(foreign)
        client.close()


def test_two_servers_share_one_pool(server_a: harness.ServerHandle, meta: harness.MetaHandle,
                                    model: str, tmp_path: Path) -> None:
    """Scenario: server A writes a prompt's KV into its own segment; server B (its own segment,
    Python's random seeded as A's) restores it from L3 with A's device-hit output."""
    ids = prompt(4)
    cold, _ = write_through(server_a, meta, ids)
    warm = generate(server_a, ids)
    assert warm["device"] >= (FULL_PAGES - 1) * 128 and warm["storage"] == 0, warm
    assert warm["text"] == cold["text"]
    assert_a_fresh_server_restores(meta, model, tmp_path, "server_b", ids, warm["text"], extra_config=EXTRA)


def test_detach_and_reattach(server_a: harness.ServerHandle, meta: harness.MetaHandle) -> None:
    """Scenario: DELETE /hicache/storage-backend closes the store (its LocalService leaves the pool,
    taking its objects); serving goes on without L3; PUT attaches a new instance that restores again."""
    import json

    assert any(k.startswith("sgl1.") for k in pool_keys(meta)), "nothing stored before the detach"
    r = request(server_a, "DELETE", "/hicache/storage-backend", idempotent=False, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert not any(k.startswith("sgl1.") for k in pool_keys(meta)), "close() left objects in the pool"
    plain = generate(server_a, prompt(8))
    assert plain["storage"] == 0 and plain["backend"] is None, plain

    r = request(server_a, "PUT", "/hicache/storage-backend", idempotent=False, headers=ADMIN, timeout=120, json={
        "hicache_storage_backend": "npu_memcache",
        "hicache_storage_backend_extra_config_json": json.dumps(server_a.extra_config)})
    assert r.status_code == 200, r.text
    ids = prompt(9)
    cold, _ = write_through(server_a, meta, ids)
    flush(server_a)
    restored = generate_from_storage(server_a, ids)
    assert restored["text"] == cold["text"]


def test_meta_service_killed_while_serving(server_a: harness.ServerHandle, meta: harness.MetaHandle) -> None:
    """Scenario: MetaService SIGKILLed -> requests still succeed (recompute, same text, no hang);
    after a restart on the same ports -> storage hits resume."""
    ids = prompt(5)
    baseline, _ = write_through(server_a, meta, ids)
    meta.stop(sig=9)
    try:
        for seed in (6, 5):  # a new prompt, then the stored one (its L3 objects are unreachable)
            if seed == 5:
                flush(server_a)
            got = generate(server_a, prompt(seed))
            assert got["seconds"] < 60, f"request took {got['seconds']:.1f}s with the MetaService down"
            assert got["storage"] == 0, got
            if seed == 5:
                assert got["text"] == baseline["text"]
    finally:
        meta.start()

    # The server's LocalService re-joins on its next heartbeat and reports what it holds; its segment
    # takes new objects once a lease TTL has passed (reads leased before the crash may still run).
    wait_for(lambda: pool_keys(meta), 30, "the re-joined LocalService to report its objects", interval_s=0.5)
    wait_for(lambda: all(s["accepts_new_objects"] for s in meta.admin("/get_all_segments")["segments"]), 30,
             "the recovered segment to take new objects again", interval_s=0.5)
    ids7 = prompt(7)
    cold, _ = write_through(server_a, meta, ids7)
    flush(server_a)
    restored = generate(server_a, ids7)
    assert restored["storage"] >= (FULL_PAGES - 1) * 128, restored
    assert restored["text"] == cold["text"]
    recovered = generate(server_a, ids)  # written before the crash, reported again on re-join
    assert recovered["storage"] >= (FULL_PAGES - 1) * 128, recovered
    assert recovered["text"] == baseline["text"]
