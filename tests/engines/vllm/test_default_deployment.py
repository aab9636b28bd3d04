"""The default deployment: every engine holds its own segment of the pool (``dram_size`` in
``kv_connector_extra_config``, no standalone LocalService), two engines seeded the same way
(vLLM seeds Python's ``random`` in every worker), one reading what the other wrote while it runs.

Covered pairwise (every pair of levels of KV shape, block size and dtype appears once):

    GQA (4 heads, 2 KV heads, 4 layers)   block 128   bfloat16   <- issue 7's scenario: 1 GB
    GQA                                   block 32    float32       segments, a 600-token prompt
    MHA (4 heads, 4 KV heads, 2 layers)   block 128   float32
    MHA                                   block 32    bfloat16

Engine A serves the prompt twice: a full prefill (no hit anywhere), then a hit in vLLM's own prefix
cache. Engine B, fresh, loads the same prefix from A's segment. B must equal A's prefix-cache hit
bit for bit (tokens and logprobs: both prefill the same suffix over the same prefix) and A's full
prefill in tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import Engine, make_model, tokens

from memcache_core.testing import running_meta_service

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = tokens(600, 77)
SHAPES = {"gqa": ("4", "256", "4", "2"), "mha": ("2", "256", "4", "4")}


@pytest.fixture(scope="module")
def meta() -> Iterator[Any]:
    """A MetaService and nothing else: the engines' own segments are the pool."""
    with running_meta_service() as m:
        yield m


def own_segment_config(meta: Any) -> dict[str, Any]:
    return {"kv_connector": "MemCacheConnector", "kv_connector_module_path": "memcache_vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"meta_service_url": meta.meta_service_url,
                                          "config_store_url": meta.config_store_url,
                                          "protocol": "host_shm", "dram_size": "1GB"}}


@pytest.mark.parametrize("shape, block, dtype", [
    ("gqa", 128, "bfloat16"),
    ("gqa", 32, "float32"),
    ("mha", 128, "float32"),
    ("mha", 32, "bfloat16"),
])
def test_engine_restores_from_a_running_peers_segment(meta: Any, tmp_path: Path, shape: str,
                                                      block: int, dtype: str) -> None:
    """Scenario: engines A and B each hold a 1 GB segment and are seeded alike. A serves the prompt
    (its full blocks go to its own segment) and stays up; B, fresh, loads them from A's segment.
    A wrong segment id (a seeded id collision) would read B's own zeroed memory with success codes
    and change B's output from the first token."""
    model = make_model(shape, *SHAPES[shape])
    hit = (len(PROMPT) - 1) // block * block
    a_ready, b_done = tmp_path / "a_ready", tmp_path / "b_done"
    common = {"model": model, "block_size": block, "dtype": dtype,
              "kv_transfer_config": own_segment_config(meta)}
    a = Engine({**common, "enable_prefix_caching": True, "steps": [
        {"generate": [PROMPT], "max_tokens": 8}, {"generate": [PROMPT], "max_tokens": 8},
        {"signal_file": str(a_ready)}, {"wait_for_file": str(b_done)}]}, tmp_path, "a")
    b = Engine({**common, "enable_prefix_caching": False, "steps": [
        {"wait_for_file": str(a_ready), "timeout_s": 600}, {"generate": [PROMPT], "max_tokens": 8},
        {"signal_file": str(b_done)}]}, tmp_path, "b")
    try:
        rb = b.result()
    finally:
        b_done.write_text("done")  # A must not wait forever if B failed
    ra = a.result()
    full, local = ra["steps"][0][0], ra["steps"][1][0]
    restored = rb["steps"][1][0]
    assert full["num_cached_tokens"] == 0
    assert local["num_cached_tokens"] == hit, "A's second serve is a local prefix-cache hit"
    assert restored["num_cached_tokens"] == hit, "B loads the prefix from A's segment"
    m = rb["metrics"]
    assert m.get("vllm:external_prefix_cache_hits", m.get("vllm:external_prefix_cache_hits_total")) == hit
    assert restored["token_ids"] == full["token_ids"], \
        f"tokens differ from the full prefill: {restored['token_ids']} vs {full['token_ids']}"
    assert restored["token_ids"] == local["token_ids"]
    assert restored["logprobs"] == local["logprobs"], "logprobs differ from vLLM's own prefix hit"
