"""MemCacheConnector against a real vLLM engine (CPU build), a real pool and a tiny local model.

Every restore is compared with a run without the connector (tokens and logprobs). One engine
lifetime costs ~40-60 s here, so each test packs several checks into few lifetimes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    BLOCK,
    CROWD,
    CROWD_BLOCKS,
    CROWD_MAX_TOKENS,
    MAX_TOKENS,
    P1,
    P2,
    P3,
    P4,
    P5,
    Engine,
    Pool,
    assert_same_output,
    full_hit,
    metric,
)

from memcache_core.testing import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]

P1_BLOCKS = len(P1) // BLOCK


def gen(*prompts: list[int]) -> dict[str, Any]:
    return {"generate": list(prompts), "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def seeded(pool: Pool, tiny_model: str, baseline: dict[str, Any], tmp_path_factory) -> Pool:
    """Instance A computes P1 and P2 (P1 + 150 tokens), saves their full blocks, then exits."""
    spec = {"model": tiny_model, "block_size": BLOCK, "enable_prefix_caching": False,
            "kv_transfer_config": pool.kv_transfer_config(), "steps": [gen(P1), gen(P2)]}
    res = Engine(spec, tmp_path_factory.mktemp("seed"), "instance_a").result()
    p1, p2 = res["steps"][0][0], res["steps"][1][0]
    assert p1["num_cached_tokens"] == 0
    assert_same_output(p1, baseline["P1"], "saving instance, P1")
    assert_same_output(p2, baseline["P2"], "saving instance, P2")
    # Saves are asynchronous; the engine frees a request's blocks (and exits) only after they are done.
    assert len(pool.keys()) == len(P2) // BLOCK, "one key per full prompt block (one rank)"
    return pool


def test_fresh_instance_loads_saved_prefix(seeded: Pool, engines, baseline) -> None:
    """Scenario: A saved P1 and P2 and exited. A fresh instance B (new processes, no local prefix
    cache) gets P1's blocks from the pool, and for P5 (P1 + 150 other tokens) the blocks it shares
    with P1; outputs are those of a run without the connector. B saves only P5's new blocks."""
    before = set(seeded.keys())
    res = engines("instance_b", [gen(P1), gen(P5)], seeded.kv_transfer_config()).result()
    p1, p5 = res["steps"][0][0], res["steps"][1][0]
    assert p1["num_cached_tokens"] == full_hit(P1) == 288
    assert p5["num_cached_tokens"] == P1_BLOCKS * BLOCK
    assert_same_output(p1, baseline["P1"], "P1 loaded from the pool")
    assert_same_output(p5, baseline["P5"], "P5 with P1's prefix from the pool")
    assert metric(res, "external_prefix_cache_hits") == full_hit(P1) + P1_BLOCKS * BLOCK
    assert metric(res, "memcache_load_blocks") == 2 * P1_BLOCKS
    assert metric(res, "memcache_load_failed_blocks") == 0
    after = set(seeded.keys())
    assert before < after and len(after - before) == len(P5) // BLOCK - P1_BLOCKS


def test_two_instances_at_once_async_and_sync(seeded: Pool, engines, baseline, tmp_path: Path) -> None:
    """Scenario: instances C (asynchronous loads) and D (synchronous loads, vLLM's local prefix
    cache on) run at the same time on one pool. Both load P1 (saved by A). C computes P3 and saves
    it; D then loads P3 from C's blocks while C is still running. D's P2 takes P1's blocks from its
    local prefix cache and only the rest from the pool. All outputs equal the baseline."""
    ready_c, ready_d, go, c_saved = (tmp_path / n for n in ("ready_c", "ready_d", "go", "c_saved"))
    c = engines("instance_c", [{"signal_file": str(ready_c)}, {"wait_for_file": str(go)},
                               gen(P1), gen(P3), {"signal_file": str(c_saved)},
                               {"wait_for_file": str(tmp_path / "d_done")}],
                seeded.kv_transfer_config(load_async=True))
    d = engines("instance_d", [{"signal_file": str(ready_d)}, {"wait_for_file": str(go)},
                               gen(P1), {"wait_for_file": str(c_saved)}, gen(P3), gen(P2),
                               {"signal_file": str(tmp_path / "d_done")}],
                seeded.kv_transfer_config(), enable_prefix_caching=True)
    def started() -> bool:
        assert c.proc.poll() is None and d.proc.poll() is None, "an instance died during start-up"
        return ready_c.exists() and ready_d.exists()

    wait_for(started, 400, "both instances to start", interval_s=0.2)
    go.write_text("go")
    rc, rd = c.result(), d.result()
    c_p1, c_p3 = rc["steps"][2][0], rc["steps"][3][0]
    d_p1, d_p3, d_p2 = rd["steps"][2][0], rd["steps"][4][0], rd["steps"][5][0]
    for name, out in (("C P1", c_p1), ("D P1", d_p1)):
        assert out["num_cached_tokens"] == full_hit(P1), name
        assert_same_output(out, baseline["P1"], name)
    assert c_p3["num_cached_tokens"] == 0
    assert_same_output(c_p3, baseline["P3"], "C P3 computed")
    assert d_p3["num_cached_tokens"] == full_hit(P3), "D loads the blocks C saved while C runs"
    assert_same_output(d_p3, baseline["P3"], "D P3 loaded from C's blocks")
    assert d_p2["num_cached_tokens"] == full_hit(P2)
    assert_same_output(d_p2, baseline["P2"], "D P2: local prefix cache plus pool")
    assert metric(rc, "memcache_load_blocks") == P1_BLOCKS
    # D loaded P1, P3 and only P2's blocks beyond P1 (P1's came from its local prefix cache).
    assert metric(rd, "memcache_load_blocks") == P1_BLOCKS + full_hit(P3) // BLOCK + \
        (full_hit(P2) // BLOCK - P1_BLOCKS)


def test_blocks_removed_before_load_are_recomputed(seeded: Pool, engines, baseline) -> None:
    """Scenario: between the lookup and the load, half of the blocks disappear from the pool (the
    fault-injecting connector removes them, synchronous and asynchronous loads). vLLM is told
    through get_block_ids_with_load_errors, recomputes them (kv_load_failure_policy=recompute) and
    the output still equals the baseline."""
    for name, extra in (("sync", {}), ("async", {"load_async": True})):
        before = set(seeded.keys())
        res = engines(f"faulty_{name}", [gen(P1)],
                      seeded.kv_transfer_config(module="faulty_connector", **extra)).result()
        out = res["steps"][0][0]
        assert_same_output(out, baseline["P1"], f"{name} load with missing blocks")
        assert metric(res, "memcache_load_failed_blocks") > 0, name
        assert metric(res, "memcache_load_blocks") == P1_BLOCKS // 2, name
        # The recomputed blocks were saved again: the pool is whole for the next instance.
        assert set(seeded.keys()) == before, name


def test_meta_service_down_is_a_miss(seeded: Pool, engines, baseline, tmp_path: Path) -> None:
    """Scenario: the MetaService dies while an instance runs. Its next request is a miss (no hang,
    no crash, output equals the baseline)."""
    stop, stopped = tmp_path / "stop_meta", tmp_path / "meta_stopped"
    e = engines("meta_down", [gen(P1), {"signal_file": str(stop)}, {"wait_for_file": str(stopped)},
                              gen(P4)], seeded.kv_transfer_config())
    def asked_to_stop() -> bool:
        assert e.proc.poll() is None, "instance died"
        return stop.exists()

    wait_for(asked_to_stop, 400, "the instance's first request", interval_s=0.2)
    keys = len(seeded.keys())
    seeded.meta.stop()
    stopped.write_text("ok")
    t0 = time.monotonic()
    try:
        res = e.result()
        elapsed = time.monotonic() - t0
    finally:
        # The tests after this one write to the pool; the first did so inside the re-joined
        # segment's grace and every save was refused (nothing else in this pool has room).
        seeded.restart_meta(keys)
    assert elapsed < 120, "a dead MetaService must not stall the engine"
    p1, p4 = res["steps"][0][0], res["steps"][3][0]
    assert p1["num_cached_tokens"] == full_hit(P1)
    assert_same_output(p1, baseline["P1"], "P1 before the MetaService died")
    assert p4["num_cached_tokens"] == 0
    assert_same_output(p4, baseline["P4"], "P4 with the MetaService down")


def test_preemption_with_async_saves(seeded: Pool, engines, baseline) -> None:
    """Scenario: three requests decode in a KV cache too small for all of them, so vLLM preempts
    some while their asynchronous saves may still be reading their blocks, and gives the freed
    blocks to others (blocks filled by generated tokens are saved too, so saves run all along).
    The worker finishes a preempted request's saves before the next forward overwrites them;
    preempted requests come back loading their prompt and generated blocks from the pool. Every
    output equals the run without the connector and without preemption."""
    res = engines("crowd", [{"generate": CROWD, "max_tokens": CROWD_MAX_TOKENS, "batch": True}],
                  seeded.kv_transfer_config(save_decode_cache=True), num_gpu_blocks_override=CROWD_BLOCKS,
                  max_model_len=1024).result()
    assert metric(res, "num_preemptions") > 0, "the test needs vLLM to preempt"
    for i, out in enumerate(res["steps"][0]):
        assert out["token_ids"] == baseline[f"crowd{i}"]["token_ids"], f"request {i}"
        # A resumed request recomputes its generated tokens in one prefill instead of one by one,
        # which may move the last bits of later logprobs; tokens must not change.
        assert out["logprobs"] == pytest.approx(baseline[f"crowd{i}"]["logprobs"], abs=1e-3), i
    assert metric(res, "memcache_load_blocks") > len(CROWD[0]) // BLOCK, \
        "a resumed request loads its prompt and generated blocks"
