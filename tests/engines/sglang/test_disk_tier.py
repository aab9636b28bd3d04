"""A disk tier under the server's own segment, configured through the extra config: the server's
DRAM holds fewer pages than the prompt, so an L3 restore of the prompt reads most of it from disk,
with the output of the server that computed it."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from conftest import FULL_PAGES, PAGE, flush, generate, pool_keys, prompt, start, wait_for_new_keys
from memcache_sglang import testing as harness

from memcache_core.testing import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

PAGE_OBJECT = 262_144 + 320   # one page of the tiny model (2 layers, 4 KV heads of 64, bf16) and its header
DRAM = 12 * PAGE_OBJECT       # holds 10 pages below the eviction mark (90%); the prompt has 25
STEPS = (1200, 2400, 3200)    # the prompt grows in turns: each turn's pages reach the disk before the next


def stats(meta: harness.MetaHandle) -> dict:
    return meta.admin("/api/v1/stats")


def disk_counter(meta: harness.MetaHandle, name: str) -> int:
    return sum(t["counters"].get(name, 0) for t in stats(meta)["disk_tiers"])


def in_dram(meta: harness.MetaHandle, keys: set[str]) -> set[str]:
    found = meta.admin("/batch_query_keys?keys=" + ",".join(sorted(keys)))["keys"]
    assert all(f["exists"] for f in found), [f["key"] for f in found if not f["exists"]]
    return {f["key"] for f in found if f["locations"]}


def disk_objects_at_least(meta: harness.MetaHandle, n: int) -> bool:
    return disk_counter(meta, "objects") >= n


def test_restore_from_disk_when_dram_holds_less_than_the_prompt(meta: harness.MetaHandle, model: str,
                                                                 tmp_path: Path) -> None:
    ids = prompt(80)
    disk = tmp_path / "disk"
    server = start(meta, model, tmp_path, "disk_tier", extra_config={
        "client_timeout_seconds": 5, "dram_size": str(DRAM), "disk_path": str(disk), "disk_size": "64MB",
        "disk_write_policy": "write_through"})
    try:
        written: set[str] = set()
        for tokens in STEPS:
            before = pool_keys(meta)
            last = generate(server, ids[:tokens])
            written |= wait_for_new_keys(meta, before, tokens // PAGE - len(written))
            n = len(written)
            wait_for(partial(disk_objects_at_least, meta, n), 60, "the turn's pages on disk")
        assert len(written) == FULL_PAGES and (disk / "r0p0c0").is_dir()
        disk_only = written - in_dram(meta, written)
        assert len(disk_only) >= FULL_PAGES - int(0.9 * DRAM) // PAGE_OBJECT, f"only {len(disk_only)} pages left DRAM"
        assert stats(meta)["counters"]["evictions_to_disk"] >= len(disk_only)
        reads_before = disk_counter(meta, "reads")

        flush(server)
        restored = generate(server, ids)
        assert restored["device"] == 0 and restored["host"] == 0, restored
        assert restored["storage"] >= (FULL_PAGES - 1) * PAGE, restored
        assert restored["text"] == last["text"]
        # Every page that was on disk only was read from disk once at least: by its promotion
        # (disk_prefetch, started by batch_exists) or by the restore's own read, whichever came first.
        wait_for(lambda: disk_counter(meta, "reads") - reads_before >= len(disk_only) - 1, 30,
                 "the provider's count of disk reads")
    finally:
        server.stop()
