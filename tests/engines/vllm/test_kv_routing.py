"""KV-aware routing against real vLLM engines (docs/vllm.md "KV-aware routing"): a router computes a
prompt's block hashes with vLLM's own functions, reads the engine's KV-event stream with vLLM's own
decoder, and finds every block of the prompt announced as held by the pool (medium ``CPU``), once
per block, with its parent, its tokens, the engine's block size and the adapter's name.

The engine holds its own segment of the pool (``dram_size`` on the connector) and publishes on an
``ipc://`` endpoint with a replay socket; the test reads the whole stream back by replay from
sequence 0, so no batch is lost to a subscription that was not yet connected.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVEventBatch
from vllm_harness import BLOCK, Engine, Pool, engine_spec, tokens, write_adapter

from memcache_core.testing import free_port, running_meta_service, started, wait_for

pytestmark = pytest.mark.engine

PROMPT = tokens(140, 39)        # 4 full blocks of 32 and 12 tokens more
N_BLOCKS = len(PROMPT) // BLOCK
TOPIC = "kv@pod-a@tiny"
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def router_hashes(prompt: list[int], lora: Any = None) -> list[int]:
    """The prompt's full blocks' hashes as a router computes them: vLLM's ``hash_block_tokens``
    chain (sha256, the fixed none-hash), with the extra keys vLLM hashes for the adapter, each read
    as routers read a hash (an int as is, bytes as their last 8 bytes)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(hash_fn)
    request = Request("router", prompt, SamplingParams(), None, lora_request=lora)
    out: list[int] = []
    parent = None
    for i in range(len(prompt) // BLOCK):
        extra, _ = kcu.generate_block_hash_extra_keys(request, i * BLOCK, (i + 1) * BLOCK, 0)
        parent = kcu.hash_block_tokens(hash_fn, parent, prompt[i * BLOCK:(i + 1) * BLOCK], extra)
        out.append(as_router(parent))
    return out


def as_router(h: int | bytes) -> int:
    return h if isinstance(h, int) else int.from_bytes(bytes(h)[-8:], "big")


def replay(endpoint: str) -> list[tuple[bytes, KVEventBatch]]:
    """Every batch the engine published, from sequence 0, through its replay socket."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out: list[tuple[bytes, KVEventBatch]] = []
        while True:
            assert sock.poll(30_000), f"no replay from {endpoint}"
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((topic, DECODER.decode(payload)))   # vLLM's own decoder
    finally:
        sock.close(linger=0)


def pool_events(batches: list[tuple[bytes, KVEventBatch]]) -> list[BlockStored | BlockRemoved]:
    for topic, _ in batches:
        assert topic == TOPIC.encode(), f"a batch on topic {topic!r}, not the engine's"
    return [ev for _, b in batches for ev in b.events
            if isinstance(ev, BlockStored | BlockRemoved) and ev.medium == MEDIUM_CPU]


@contextlib.contextmanager
def engine_with_events(tmp_path: Path, model: str, steps: list[dict[str, Any]], connector: dict[str, Any] | None = None,
                       **spec: Any) -> Iterator[tuple[Engine, Pool, Callable[[], list[BlockStored | BlockRemoved]]]]:
    """An engine (its own pool segment, vLLM's KV events on, vLLM's prefix cache on unless ``spec``
    says otherwise) running ``steps``, its pool, and a function that reads the pool's events of its
    stream so far. ``connector``: more ``kv_connector_extra_config`` keys."""
    replay_endpoint = f"ipc://{tmp_path}/kv-replay"
    events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": TOPIC,
                  "endpoint": f"ipc://{tmp_path}/kv-events", "replay_endpoint": replay_endpoint}
    with running_meta_service(kv_events_enable=True, kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                              kv_events_block_size=BLOCK) as meta:
        pool = Pool(meta, tmp_path)
        kv = pool.kv_transfer_config(dram_size="64MB", cache_prefix="routing", **(connector or {}))
        with started(lambda name, s: Engine(s, tmp_path, name), Engine.kill) as start:
            engine = start("engine", engine_spec(model, BLOCK, steps, kv, kv_events_config=events_cfg,
                                                 **{"enable_prefix_caching": True, **spec}))
            yield engine, pool, lambda: pool_events(replay(replay_endpoint))


def wait_for_file(engine: Engine, path: Path) -> None:
    def there() -> bool:
        assert engine.proc.poll() is None, engine.log.read_text()[-4000:]
        return path.exists()

    wait_for(there, 600, f"the engine to reach {path.name}", interval_s=0.5)


def wait_for_events(read: Callable[[], list[BlockStored | BlockRemoved]],
                    done: Callable[[list[BlockStored | BlockRemoved]], bool], what: str) -> list[BlockStored | BlockRemoved]:
    seen: list[BlockStored | BlockRemoved] = []

    def check() -> bool:
        seen[:] = read()
        return done(seen)

    wait_for(check, 60, lambda: f"{what}; the stream has {seen}", interval_s=0.5)
    return seen


def n_stored(events: list[BlockStored | BlockRemoved]) -> int:
    return sum(isinstance(ev, BlockStored) for ev in events)


def run_and_read(tmp_path: Path, model: str, **spec: Any) -> tuple[list[BlockStored | BlockRemoved], list[str]]:
    """One engine runs PROMPT twice and stays up until its stream announces ``N_BLOCKS`` blocks in
    the pool (or a deadline). Returns the pool's events of the stream and the pool's keys."""
    lora = spec.pop("lora", None)
    ready, go = tmp_path / "ran", tmp_path / "go"
    gen = {"generate": [PROMPT], "max_tokens": 4, **({"lora": lora} if lora else {})}
    steps = [gen, gen, {"signal_file": str(ready)}, {"wait_for_file": str(go), "timeout_s": 300}]
    with engine_with_events(tmp_path, model, steps, **spec) as (engine, pool, read):
        wait_for_file(engine, ready)
        seen = wait_for_events(read, lambda evs: n_stored(evs) >= N_BLOCKS, f"{N_BLOCKS} blocks announced")
        keys = pool.keys()
        go.write_text("go")
        engine.result()
    return seen, keys


def assert_every_block_announced_once(events: list[BlockStored | BlockRemoved], prompt: list[int],
                                      hashes: list[int], lora_name: str | None = None) -> None:
    stored = [ev for ev in events if isinstance(ev, BlockStored)]
    assert not [ev for ev in events if isinstance(ev, BlockRemoved)], events
    counts = Counter(as_router(h) for ev in stored for h in ev.block_hashes)
    assert [counts[h] for h in hashes] == [1] * len(hashes), \
        f"each of the prompt's {len(hashes)} blocks announced once in the pool: {counts}"
    by_hash = {as_router(ev.block_hashes[0]): ev for ev in stored}
    for i, h in enumerate(hashes):
        ev = by_hash[h]
        assert len(ev.block_hashes) == 1 and ev.block_size == BLOCK
        assert ev.token_ids == prompt[i * BLOCK:(i + 1) * BLOCK], f"block {i}: not its tokens"
        parent = None if ev.parent_block_hash is None else as_router(ev.parent_block_hash)
        assert parent == (hashes[i - 1] if i else None), f"block {i}: not its parent"
        assert ev.lora_name == lora_name


@pytest.mark.timeout(900)
@pytest.mark.parametrize("connector", [{}, {"use_layerwise": True}], ids=["whole_block", "layerwise"])
def test_a_router_finds_every_block_of_a_prompt_in_the_pool(tmp_path: Path, tiny_model: str,
                                                            connector: dict[str, Any]) -> None:
    """Scenario (issue 39): a vLLM engine with the connector (block size 32, its own pool segment),
    the MetaService publishing its own stream, vLLM's KV events on; a 140-token prompt (4 full
    blocks) runs twice. A router computing the prompt's hashes the way vLLM does finds all 4 blocks
    on the engine's stream as ``BlockStored`` with medium ``CPU``, each once, with its parent, its
    tokens and the engine's block size (before: 0 of 4; vLLM's own ``GPU`` events only). The same
    when the blocks are saved layer by layer (``use_layerwise``)."""
    events, keys = run_and_read(tmp_path, tiny_model, connector=connector)
    assert len(keys) == N_BLOCKS, keys
    assert_every_block_announced_once(events, PROMPT, router_hashes(PROMPT))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp2_announces_each_block_once(tmp_path: Path, tiny_model: str) -> None:
    """Scenario: the same at TP 2: the pool holds two keys per block (one per rank), the engine's
    stream announces each block once, after both ranks saved it."""
    events, keys = run_and_read(tmp_path, tiny_model, tensor_parallel_size=2)
    ranks = Counter(re.search(r"@tp(\d)of2@", k)[1] for k in keys)   # type: ignore[index]
    assert ranks == {"0": N_BLOCKS, "1": N_BLOCKS}, keys
    assert_every_block_announced_once(events, PROMPT, router_hashes(PROMPT))


@pytest.mark.timeout(900)
def test_lora_blocks_carry_the_adapter(tmp_path: Path, tiny_model: str) -> None:
    """Scenario: the prompt runs with LoRA adapter "ad": the blocks are announced under vLLM's hashes
    with the adapter (name and path in the extra keys), with ``lora_name`` "ad"; the hashes without
    the adapter match none of them."""
    from vllm.lora.request import LoRARequest

    adapter = tmp_path / "adapter"
    write_adapter(adapter, tiny_model, seed=1)
    lora = ["ad", 1, str(adapter)]
    events, _ = run_and_read(tmp_path, tiny_model, lora=lora, enable_lora=True, max_lora_rank=8)
    hashes = router_hashes(PROMPT, LoRARequest(*lora))
    assert_every_block_announced_once(events, PROMPT, hashes, lora_name="ad")
    plain = set(router_hashes(PROMPT))
    assert not plain & {as_router(h) for ev in events for h in ev.block_hashes}


@pytest.mark.timeout(900)
def test_blocks_the_pool_lost_are_announced_removed(tmp_path: Path, tiny_model: str) -> None:
    """Scenario: the engine (vLLM's prefix cache off) runs the prompt; its 4 blocks are announced.
    The pool then loses them (removed behind the engine's back, as eviction or a dead provider would).
    The prompt runs again: the lookup finds them missing, so the stream announces them removed (one
    ``BlockRemoved``, medium ``CPU``, with the 4 hashes), then stored again once recomputed and saved."""
    from memcache_core import DistributedObjectStore, LocalConfig

    ran, go, again, end = (tmp_path / n for n in ("ran", "go", "again", "end"))
    gen = {"generate": [PROMPT], "max_tokens": 4}
    steps: list[dict[str, Any]] = [gen, {"signal_file": str(ran)}, {"wait_for_file": str(go), "timeout_s": 300},
                                   gen, {"signal_file": str(again)}, {"wait_for_file": str(end), "timeout_s": 300}]
    hashes = router_hashes(PROMPT)
    with engine_with_events(tmp_path, tiny_model, steps, enable_prefix_caching=False) as (engine, pool, read):
        wait_for_file(engine, ran)
        wait_for_events(read, lambda evs: n_stored(evs) >= N_BLOCKS, f"{N_BLOCKS} blocks announced")
        keys = pool.keys()
        assert len(keys) == N_BLOCKS, keys
        client = DistributedObjectStore()
        cfg = LocalConfig(meta_service_url=pool.meta.meta_service_url, config_store_url=pool.meta.config_store_url,
                          protocol="host_shm", dram_size="0")
        assert client.setup(cfg) == 0 and client.init(0, init_bm=False) == 0
        try:
            assert list(client.remove_batch(keys)) == [0] * N_BLOCKS
        finally:
            client.close()
        go.write_text("go")
        wait_for_file(engine, again)
        events = wait_for_events(read, lambda evs: n_stored(evs) >= 2 * N_BLOCKS, "the blocks announced again")
        end.write_text("end")
        res = engine.result()
    removed = [ev for ev in events if isinstance(ev, BlockRemoved)]
    assert len(removed) == 1 and [as_router(h) for h in removed[0].block_hashes] == hashes, removed
    first, second = events[:N_BLOCKS], events[N_BLOCKS + 1:]
    assert events[N_BLOCKS] is removed[0], "removed between the two announcements"
    assert_every_block_announced_once(first, PROMPT, hashes)
    assert_every_block_announced_once(second, PROMPT, hashes)
    assert res["steps"][3][0]["num_cached_tokens"] == 0, "the lost blocks were recomputed"
