"""A provider with a disk tier under a DRAM segment smaller than the prompt's blocks: vLLM saves a
prompt in two turns (each turn's blocks reach the disk before the next turn evicts them), then, its
local prefix cache reset, loads the whole prompt back, partly from the provider's disk, with the
output of a run without the connector. One engine lifetime.

The second turn takes the first turn's blocks from vLLM's local prefix cache: loading them from the
pool would lease them, and a segment whose objects are all leased has no room for the turn's saves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import BLOCK, MAX_TOKENS, P1, P2, Engine, Pool, assert_same_output, full_hit, metric

from memcache_core.testing import running_meta_service, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK_OBJECT = 32_768 + 320      # one block of the tiny model (2 layers, 2 KV heads of 64, bf16) and its header
DRAM = 12 * BLOCK_OBJECT         # 10 blocks below the eviction mark (90%); P2 has 14


def gen(prompt: list[int]) -> dict[str, Any]:
    return {"generate": [prompt], "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def disk_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    workdir = tmp_path_factory.mktemp("disk_pool")
    with running_meta_service() as meta:
        pool = Pool(meta, workdir)
        try:
            pool.start_local_service(dram=str(DRAM), disk_path=str(workdir / "disk"), disk_size="16MB",
                                     disk_write_policy="write_through")
            yield pool
        finally:
            pool.stop()


def disk_counter(pool: Pool, name: str) -> int:
    return sum(t["counters"].get(name, 0) for t in pool.meta.http("/api/v1/stats")["disk_tiers"])


def on_disk_only(pool: Pool) -> int:
    keys = pool.keys()
    found = pool.meta.http("/batch_query_keys?keys=" + ",".join(keys))["keys"]
    return sum(1 for f in found if f["exists"] and not f["locations"])


def release_when_on_disk(pool: Pool, engine: Engine, ready: Path, go: Path, blocks: int) -> None:
    """Once ``engine`` signals ``ready``: wait until its ``blocks`` saved blocks have disk records."""
    wait_for(lambda: ready.exists() or engine.proc.poll() is not None, 420, f"{engine.name} ready")
    assert engine.proc.poll() is None, f"{engine.name} died:\n{engine.log.read_text()[-3000:]}"
    wait_for(lambda: len(pool.keys()) >= blocks and disk_counter(pool, "objects") >= blocks, 60,
             f"{blocks} blocks saved and on disk")
    go.write_text("go")


def test_restore_from_the_providers_disk(disk_pool: Pool, engines, baseline, tmp_path: Path) -> None:
    signals = [tmp_path / f"{n}{i}" for i in (1, 2) for n in ("ready", "go")]
    steps = [gen(P1), {"signal_file": str(signals[0])}, {"wait_for_file": str(signals[1])},
             gen(P2), {"signal_file": str(signals[2])}, {"wait_for_file": str(signals[3])},
             {"reset_prefix_cache": {"reset_connector": False}}, gen(P2)]
    engine = engines("disk_restore", steps, disk_pool.kv_transfer_config(), enable_prefix_caching=True)
    release_when_on_disk(disk_pool, engine, signals[0], signals[1], len(P1) // BLOCK)
    release_when_on_disk(disk_pool, engine, signals[2], signals[3], len(P2) // BLOCK)
    disk_only = on_disk_only(disk_pool)
    assert disk_only >= len(P2) // BLOCK - int(0.9 * DRAM) // BLOCK_OBJECT, f"only {disk_only} blocks left DRAM"
    reads_before = disk_counter(disk_pool, "reads")
    res = engine.result()
    p1, p2, again = res["steps"][0][0], res["steps"][3][0], res["steps"][7][0]
    assert p1["num_cached_tokens"] == 0 and p2["num_cached_tokens"] == len(P1) // BLOCK * BLOCK
    assert res["steps"][6] is True and again["num_cached_tokens"] == full_hit(P2)
    for got, name in ((p1, "P1"), (p2, "P2"), (again, "P2")):
        assert_same_output(got, baseline[name], f"{name} with blocks from a disk tier")
    assert metric(res, "memcache_load_blocks") == full_hit(P2) // BLOCK
    assert metric(res, "memcache_load_failed_blocks") == 0
    wait_for(lambda: disk_counter(disk_pool, "reads") - reads_before >= disk_only, 30,
             "the provider's count of disk reads")
