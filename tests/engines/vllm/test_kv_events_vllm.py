"""The pool's KV events decoded by the installed vLLM's own code: its ``kv_events`` structs and a
``msgspec.msgpack.Decoder(type=KVEventBatch)``, as a vLLM-based router reads them. The scenarios
(stored / removed / evicted, replay from a late join or a missed sequence, replicas, a killed
member, AllBlocksCleared and recovery after a MetaService restart) are the core suite's, run here
with vLLM's decoder in place of the raw one."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from tests.integration.test_kv_events import (  # noqa: F401 (collected here with vLLM's decoder)
    Decode,
    test_objects_recovered_after_a_restart_are_published_again,
    test_put_remove_and_eviction_are_published,
    test_replicas_and_a_killed_member_are_published,
)

DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def vllm_decode(payload: bytes) -> list[tuple[str, list[str], str | None]]:
    batch = DECODER.decode(payload)   # raises msgspec.ValidationError on anything vLLM would reject
    out: list[tuple[str, list[str], str | None]] = []
    for ev in batch.events:
        if isinstance(ev, AllBlocksCleared):
            out.append(("AllBlocksCleared", [], None))
            continue
        assert isinstance(ev, BlockStored | BlockRemoved) and ev.medium == MEDIUM_CPU
        if isinstance(ev, BlockStored):
            assert ev.block_size == 32 and ev.token_ids == [] and ev.parent_block_hash is None
        assert all(isinstance(h, bytes) for h in ev.block_hashes)
        out.append((type(ev).__name__, [h.decode() for h in ev.block_hashes], ev.medium))  # type: ignore[union-attr]
    return out


@pytest.fixture
def decode() -> Decode:
    return vllm_decode


def test_the_array_form_is_rejected_by_vllm() -> None:
    """Negative control: the array-encoded batches the pool used to send fail vLLM's decoder, so the
    scenarios above would catch a return to them."""
    arrays = msgspec.msgpack.encode([1.0, [["BlockStored", [b"k"], None, [], 32, None, "CPU", None]]])
    with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
        DECODER.decode(arrays)
