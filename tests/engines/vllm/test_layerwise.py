"""``use_layerwise``: KV blocks moved layer by layer over the pool's GVA path (docs/vllm.md "Layer-wise").

The parts against a real pool (seconds): a save layer by layer is published only when every layer
arrived, reads back byte-exact through the whole-block path (checksum included), and loads layer by
layer no further ahead than ``layerwise_prefetch_layers``; missing blocks are failed loads. Then real
vLLM engines: outputs and logprobs with layer-wise saves and loads equal vLLM's own prefix-cache hit
and the whole-block path, for a GQA model at blocks of 32 tokens and an MHA model at 64 (TP 2 in
test_tensor_parallel.py takes the other two pairs).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from memcache_vllm.layerwise import LayerwiseWorker
from memcache_vllm.layout import BlockLayout
from memcache_vllm.stats import StatsRecorder
from vllm_harness import (
    P1,
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
from memcache_core.testing import running_meta_service

pytestmark = pytest.mark.engine

NOT_EXISTS = -3007


def _bytes(lay: BlockLayout, block: int) -> bytes:
    return b"".join(ctypes.string_at(p, n) for p, n in zip(*lay.pieces(block), strict=True))


@pytest.fixture
def store() -> Iterator[DistributedObjectStore]:
    with running_meta_service() as ms:
        cfg = LocalConfig(meta_service_url=ms.meta_service_url, config_store_url=ms.config_store_url,
                          protocol="host_shm", dram_size="64MB")
        s = DistributedObjectStore()
        assert s.setup(cfg) == 0 and s.init(0, init_bm=True) == 0
        try:
            yield s
        finally:
            s.close()


def _caches(fill: bool) -> dict[str, torch.Tensor]:
    """Three layers of 12 blocks, CPU layout and K/V-split layout mixed (1 and 2 pieces per block)."""
    make = torch.randn if fill else torch.zeros
    return {"l0": make(12, 2, 16, 32).to(torch.bfloat16), "l1": make(2, 12, 16, 2, 16).to(torch.bfloat16),
            "l2": make(12, 2, 16, 32).to(torch.bfloat16)}


def test_layerwise_save_and_load_through_a_real_pool(store: DistributedObjectStore) -> None:
    """Scenario: blocks 3, 5, 7 are saved layer by layer and published at the end; a save missing a
    layer, and one computed over a failed load, are aborted (never readable, the key free again).
    The objects read back byte-exact through the whole-block path (their checksums are true). A load
    layer by layer with one layer of prefetch: layer 1 is not copied before the forward waits for
    layer 0; blocks land byte-exact; a missing key is a failed load."""
    src, dst = _caches(True), _caches(False)
    lay_s, lay_d = BlockLayout(src, 12), BlockLayout(dst, 12)
    for lay in (lay_s, lay_d):
        for region in lay.regions():
            assert store.register_buffer(*region) == 0
    stats = StatsRecorder()
    lw = LayerwiseWorker(store, lay_s, 1, stats)
    try:
        jobs = [([3, 5], ["k3", "k5"]), ([7, 8], ["k7", "fenced"])]
        for name in src:
            lw.save_layer(name, lambda: jobs)
        assert lw.finish_save({8}) == (["k3", "k5", "k7"], ["fenced"])   # what the scheduler announces
        lw.save_layer("l0", lambda: [([9], ["half"])])   # the forward stopped after layer 0
        assert lw.finish_save(set()) == ([], ["half"])
        for name in src:   # saved again: already in the pool, so in it
            lw.save_layer(name, lambda: [([3], ["k3"])])
        assert lw.finish_save(set()) == (["k3"], [])
        assert store.batch_is_exist(["k3", "k5", "k7", "fenced", "half"]) == [1, 1, 1, 0, 0]
        assert store.batch_alloc(["half", "fenced"], [lay_s.block_bytes] * 2) == [0, 0]   # aborted: free
        assert store.batch_write_finish(["half", "fenced"], [1, 1]) == [0, 0]
        ptrs, sizes = zip(*(lay_d.pieces(b) for b in (0, 1, 2)), strict=True)
        assert store.batch_get_into_layers(["k7", "k3", "k5"], list(ptrs), list(sizes)) == [0, 0, 0]
        assert [_bytes(lay_d, b) for b in (0, 1, 2)] == [_bytes(lay_s, b) for b in (7, 3, 5)]

        lw_d = LayerwiseWorker(store, lay_d, 1, stats)
        try:
            lw_d.start_load([10, 11, 4], ["k5", "k3", "missing"])
            load = lw_d.load
            assert load is not None
            assert load.done[0].wait(30) and not load.done[1].is_set()   # one layer ahead, no more
            for name in dst:
                lw_d.wait_for_layer(name)
            assert lw_d.finish_load() == {4}
        finally:
            lw_d.shutdown()
        assert _bytes(lay_d, 10) == _bytes(lay_s, 5) and _bytes(lay_d, 11) == _bytes(lay_s, 3)
        assert not any(t.select(1 if t.dim() == 5 else 0, 4).any() for t in dst.values())
        got = stats.take()
        assert got is not None
        assert got.data["save_blocks"] == 3 and got.data["load_blocks"] == 2 and got.data["load_failed_blocks"] == 1
    finally:
        lw.shutdown()


# -- real engines ----------------------------------------------------------------------------------

MAX_TOKENS = 8


# {GQA, MHA} x {32, 64} x {TP 1, TP 2} covered pairwise in CI: (GQA, 32) and (MHA, 64) at TP 1 here,
# (GQA, 64) and (MHA, 32) at TP 2 in test_tensor_parallel.py; the rest of the cross product is opt-in.
# CPU attention takes blocks of multiples of 32 only.
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("model", "block"), [("gqa", 32), ("mha", 64), *all_shapes(("gqa", 64), ("mha", 32))])
def test_layerwise_restores_equal_vllm_prefix_hits_and_whole_blocks(model: str, block: int,
                                                                    tmp_path: Path) -> None:
    """Scenario: engine R (no connector, vLLM's own prefix cache) runs P1 twice (the second is a
    prefix-cache hit) and P5. Engine L (use_layerwise, no local prefix cache) computes P1 and saves
    it layer by layer, then runs P1 again and P5, loading their shared blocks layer by layer from the
    pool. Engine W (whole-block path) runs P1 and P5 from what L saved (P5 whole, L saved its blocks
    too). Tokens and logprobs of every restore equal R's, every load was whole (no failed block), and
    L went through the GVA path (the MetaService answered its Info and Lease requests)."""
    tiny = make_model(f"lw-{model}", *SHAPES[model])
    steps = [{"generate": [P1], "max_tokens": MAX_TOKENS}, {"generate": [P1], "max_tokens": MAX_TOKENS},
             {"generate": [P5], "max_tokens": MAX_TOKENS}]
    hit = (len(P1) - 1) // block * block
    shared = len(P1) // block * block

    with own_pool(tmp_path) as (pool, start):
        # R needs no pool: it runs beside L (the thread count is fixed, so logprobs compare bit for bit)
        engines = [start("reference", engine_spec(tiny, block, steps, None, enable_prefix_caching=True)),
                   start("layerwise", engine_spec(tiny, block, steps, pool.kv_transfer_config(
                       use_layerwise=True, layerwise_prefetch_layers=1)))]
        ref, lw = (e.result() for e in engines)
        text = pool.meta.http("/metrics")
        for op in ("info", "lease"):
            m = re.search(rf'^memcache_request_seconds_count{{op="{op}"}} (\S+)$', text, re.M)
            assert m and float(m.group(1)) > 0, f"L made no {op} request: the layer-wise path did not run"
        whole = start("whole_block", engine_spec(tiny, block, steps, pool.kv_transfer_config())).result()
    r1, r1_hit, r5 = (s[0] for s in ref["steps"])
    assert r1_hit["num_cached_tokens"] == hit, "R's second P1 is vLLM's own prefix-cache hit"
    assert_same_output(r1_hit, r1, "vLLM's prefix-cache hit against its own computation")
    l1, l1_hit, l5 = (s[0] for s in lw["steps"])
    assert l1["num_cached_tokens"] == 0
    assert (l1_hit["num_cached_tokens"], l5["num_cached_tokens"]) == (hit, shared)
    w1, _, w5 = (s[0] for s in whole["steps"])
    assert (w1["num_cached_tokens"], w5["num_cached_tokens"]) == (hit, (len(P5) - 1) // block * block)
    for what, got, want in (("layer-wise save", l1, r1), ("layer-wise restore of P1", l1_hit, r1_hit),
                            ("layer-wise restore of P5's prefix", l5, r5),
                            ("whole-block restore of layer-wise saved P1", w1, r1_hit),
                            ("whole-block restore of layer-wise saved P5", w5, r5)):
        assert_same_output(got, want, what)
    for res in (lw, whole):
        assert metric(res, "memcache_load_failed_blocks") == 0
    assert metric(lw, "memcache_load_blocks") == (hit + shared) // block
    assert metric(lw, "memcache_save_blocks") == len(P5) // block
