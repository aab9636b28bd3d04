"""Tensor parallelism (TP 2) against real vLLM engines: each rank stores its own key per block
(docs/vllm.md "Keys"), and restores, whole-block and layer-wise (docs/vllm.md "Layer-wise"), read
every rank's share back byte for byte.

On this CPU backend the two ranks are two worker processes, each bound to its share of the CPUs
(``llm_runner.bind_ranks``), talking over gloo and shared memory.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    P1,
    P2,
    P5,
    SHAPES,
    all_shapes,
    assert_same_output,
    engine_spec,
    make_model,
    metric,
    own_pool,
)

from memcache_core import DistributedObjectStore, LocalConfig

pytestmark = pytest.mark.engine

TP = 2
MAX_TOKENS = 8
RANK_KEY = re.compile(r"^(?P<head>.*@)tp(?P<rank>\d+)of(?P<size>\d+)@pp0of1@(?P<block>[^@]+)$")


def read_objects(meta: Any, keys: list[str]) -> list[bytes]:
    """The committed objects ``keys``, read by a client of the pool that holds no memory."""
    store = DistributedObjectStore()
    cfg = LocalConfig(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url,
                      protocol="host_shm", dram_size="0")
    assert store.setup(cfg) == 0 and store.init(0, init_bm=False) == 0
    try:
        return store.get_batch(keys)
    finally:
        store.close()


# With test_layerwise.py's (GQA, 32) and (MHA, 64) at TP 1, these two cover {GQA, MHA} x {32, 64} x
# {TP 1, TP 2} pairwise; the other two TP-2 shapes are opt-in.
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("model", "block"), [("gqa", 64), ("mha", 32), *all_shapes(("gqa", 32), ("mha", 64))])
def test_tp2_ranks_store_their_own_keys_and_restores_equal_vllm(model: str, block: int, tmp_path: Path) -> None:
    """Scenario, TP 2: a GQA model (2 KV heads: one per rank) with blocks of 64 tokens, an MHA model
    (4 KV heads: two per rank) with blocks of 32. Engine W, a fresh TP-2 consumer on the
    whole-block path, computes P2 cold while the pool is empty. Then engine L (use_layerwise, vLLM's
    prefix cache on) computes P5 cold and saves it layer by layer, runs P5 and P1 again (vLLM's own
    prefix-cache hits), and, dropping its prefix cache before each, runs P5 and P1 loading them layer
    by layer from the pool, and P2, which loads P1's blocks layer by layer, computes the rest and
    saves its new blocks layer by layer. Then W restores P5, P1 and P2 from what L saved.

    Every restore's tokens and logprobs equal a cold computation (P5 in L, P2 in W) or vLLM's own
    prefix-cache hit (P1). The pool holds one key per block per rank: for each block a ``tp0of2`` and
    a ``tp1of2`` key, with the same namespace and block name and different bytes (each rank's own KV
    heads). Each engine's load and save counts are its two ranks' sum: both ranks loaded every block,
    none failed."""
    tiny = make_model(f"lw-{model}", *SHAPES[model])
    w_cold, l_done = tmp_path / "reader_cold.done", tmp_path / "writer.done"
    gen: Any = lambda p: {"generate": [p], "max_tokens": MAX_TOKENS}   # noqa: E731
    reset = {"reset_prefix_cache": {"reset_connector": False}}
    hit1, hit = (len(P1) - 1) // block * block, (len(P5) - 1) // block * block   # P2 and P5: 450 tokens
    shared = len(P1) // block * block    # P2's blocks in P5's objects

    # engine core in the runner's process: one process fewer to start per engine
    tp = {"tensor_parallel_size": TP, "engine_in_process": True}
    with own_pool(tmp_path) as (pool, start):
        # started together, so that their start-ups overlap; the files order their steps
        engines = [
            start("layerwise", engine_spec(
                tiny, block, [{"wait_for_file": str(w_cold), "timeout_s": 600}, gen(P5), gen(P5), gen(P1), reset,
                              gen(P5), reset, gen(P1), reset, gen(P2), {"signal_file": str(l_done)}],
                pool.kv_transfer_config(use_layerwise=True, layerwise_prefetch_layers=1),
                enable_prefix_caching=True, **tp)),
            start("whole_block", engine_spec(
                tiny, block, [gen(P2), {"signal_file": str(w_cold)}, {"wait_for_file": str(l_done), "timeout_s": 600},
                              gen(P5), gen(P1), gen(P2)],
                pool.kv_transfer_config(kv_role="kv_consumer", consumer_is_to_load=True), **tp)),
        ]
        lw, whole = (e.result() for e in engines)
        keys = pool.keys()
        objects = dict(zip(keys, read_objects(pool.meta, keys), strict=True))

    # (b) every rank wrote its own key per block
    by_block: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for key in keys:
        m = RANK_KEY.match(key)
        assert m and int(m["size"]) == TP, f"{key!r} does not name its rank as tp<r>of{TP}"
        by_block[m["head"], m["block"]][int(m["rank"])] = key
    assert len(by_block) == len(P5) // block + len(P2) // block - shared // block, \
        f"one namespace and the blocks of P5 and P2 expected: {keys}"
    for ranks in by_block.values():
        assert sorted(ranks) == list(range(TP)), f"a block without a key of every rank: {ranks}"
        k0, k1 = ranks[0], ranks[1]
        assert len(objects[k0]) == len(objects[k1]) > 0, f"{k0} / {k1}: not both readable, or not one shape"
        assert objects[k0] != objects[k1], f"{k0} and {k1} hold the same bytes: not each rank's own KV head"

    # (a) restores equal the cold computation and vLLM's own prefix-cache hit
    _, cold5, hit5_vllm, hit1_vllm, reset1, lw5, reset2, lw1, reset3, lw2, _ = (
        s[0] if isinstance(s, list) else s for s in lw["steps"])
    cold2, _, _, w5, w1, w2 = (s[0] if isinstance(s, list) else s for s in whole["steps"])
    assert [reset1, reset2, reset3] == [True] * 3, "L could not drop its prefix cache"
    assert [r["num_cached_tokens"] for r in (cold5, hit5_vllm, hit1_vllm, lw5, lw1, lw2)] == \
        [0, hit, hit1, hit, hit1, shared]
    assert [r["num_cached_tokens"] for r in (cold2, w5, w1, w2)] == [0, hit, hit1, hit]
    assert_same_output(hit5_vllm, cold5, "vLLM's own prefix-cache hit of P5 against its computation",
                       across_shapes=True)
    for what, got, want in (("layer-wise restore of P5", lw5, cold5), ("layer-wise restore of P1", lw1, hit1_vllm),
                            ("layer-wise partial restore of P2", lw2, cold2),
                            ("whole-block restore of P5 in a fresh TP-2 engine", w5, cold5),
                            ("whole-block restore of P1 in a fresh TP-2 engine", w1, hit1_vllm),
                            ("whole-block restore of P2 (saved layer by layer over a load)", w2, cold2)):
        assert_same_output(got, want, what, across_shapes=True)   # (a cold computation or a hit: other shapes)
    for res in (lw, whole):
        assert metric(res, "memcache_load_failed_blocks") == 0
    assert metric(lw, "memcache_save_blocks") == TP * len(by_block)
    assert metric(lw, "memcache_load_blocks") == TP * (hit + hit1 + shared) // block
    assert metric(whole, "memcache_save_blocks") == 0
    assert metric(whole, "memcache_load_blocks") == TP * (hit + hit1 + hit) // block
