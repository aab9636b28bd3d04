"""KV events of a real MetaService, seen by a real ZeroMQ SUB socket: put, remove, eviction, replicas,
member loss, restart, replay and CURVE. The raw msgpack is decoded here without our structs (the
format is the contract); tests/engines/vllm/test_kv_events_vllm.py runs the same scenarios with
vLLM's own structs and decoder (the ``decode`` fixture)."""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec
import pytest
import zmq
import zmq.auth

from memcache_core import DistributedObjectStore
from memcache_core.config import MetaConfig
from memcache_core.errors import ConfigError
from memcache_core.testing import free_port, running_meta_service, wait_for
from memcache_core.testing_kv_events import KVEventSubscriber
from tests.integration.stores import StoreProcess

pytestmark = pytest.mark.integration

LAYOUT = [4096, 4096]


def raw_decode(payload: bytes) -> list[tuple[str, list[str], str | None]]:
    """Decode a batch without our structs: an array ``[ts, events, dp rank]`` of maps, as vLLM 0.32 encodes
    them, is the contract."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and isinstance(batch[0], float) and batch[2:] in ([], [None])
    out: list[tuple[str, list[str], str | None]] = []
    for ev in batch[1]:
        assert isinstance(ev, dict)
        if ev["type"] == "AllBlocksCleared":
            assert set(ev) == {"type"}
            out.append((ev["type"], [], None))
            continue
        if ev["type"] == "BlockStored":
            assert ev["parent_block_hash"] is None and ev["token_ids"] == [] and ev["block_size"] == 32
            assert ev["lora_id"] is None
        assert ev["medium"] == "CPU"
        out.append((ev["type"], [h.decode() for h in ev["block_hashes"]], ev["medium"]))
    return out


Decode = Callable[[bytes], list[tuple[str, list[str], str | None]]]


@pytest.fixture
def decode() -> Decode:
    """How a batch is read; the vLLM suite imports these scenarios and gives vLLM's own decoder."""
    return raw_decode


def events_config(**extra: object) -> dict[str, object]:
    """The MetaService's settings; members are declared dead after the default ``heartbeat_timeout_ms``
    (a member of a test that is not about death must not die of a loaded machine's pauses)."""
    return {"kv_events_enable": True, "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}",
            "kv_events_model_name": "m1", "kv_events_block_size": 32, **extra}


def joined_store(meta, **overrides: object) -> DistributedObjectStore:
    s = DistributedObjectStore()
    assert s.setup(meta.local_config(**{"dram_size": "8MB", **overrides})) == 0 and s.init(0, True) == 0
    return s


def test_put_remove_and_eviction_are_published(decode: Decode) -> None:
    cfg = events_config(kv_events_replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    with running_meta_service(**cfg) as meta:
        sub = KVEventSubscriber(str(cfg["kv_events_endpoint"]), decode)
        s = joined_store(meta)
        try:
            sub.wait_until_subscribed(lambda k: s.put(k, b"p"))
            assert s.put("ns@block-1", b"x" * 1000) == 0
            assert s.remove("ns@block-1") == 0
            for i in range(40):                  # 40 x 400 KB into 8 MB: LRU eviction
                assert s.put(f"ns@fill-{i}", b"f" * 400_000) == 0
            evictions = meta.http("/api/v1/stats")["counters"]["evictions"]
            assert evictions > 0

            def all_removed() -> bool:
                sub.poll()
                return len(sub.keys("BlockRemoved")) == evictions + 1
            wait_for(all_removed, 10, "one BlockRemoved for the removal and one per eviction")
            removed, stored = sub.keys("BlockRemoved"), sub.keys("BlockStored")
            assert "ns@block-1" in removed and any(k.startswith("ns@fill-") for k in removed)
            assert "ns@block-1" in stored and sum(k.startswith("ns@fill-") for k in stored) == 40
            host = meta.http("/get_all_segments")["segments"][0]["host_id"]
            assert sub.topics == {f"m1|{host}|{s.get_local_service_id()}".encode()}
            assert sub.seqs == sorted(sub.seqs)
            assert meta.metric("kv_events_dropped_total") == 0

            # A subscriber that joins now replays from sequence 0: the table's AllBlocksCleared first,
            # then everything, the puts made before it existed included.
            late = KVEventSubscriber(str(cfg["kv_events_endpoint"]), decode)
            try:
                seqs = late.replay(str(cfg["kv_events_replay_endpoint"]), 0)
                assert seqs == list(range(len(seqs))) and seqs[-1] >= sub.seqs[-1]
                assert late.events[0] == ("AllBlocksCleared", "", None)
                assert late.keys("BlockRemoved") == removed
                # `sub` saw the puts from the first probe its subscription caught; PUB dropped the
                # probes before it (wait_until_subscribed). The replay from 0 has those too.
                replayed = late.keys("BlockStored")
                missed = replayed[:len(replayed) - len(stored)]
                assert replayed[len(missed):] == stored and all(k.startswith("probe-") for k in missed), missed
                # and from a missed sequence on: exactly the batches from there
                assert late.replay(str(cfg["kv_events_replay_endpoint"]), sub.seqs[-1]) == [sub.seqs[-1]]
            finally:
                late.close()
        finally:
            s.close()
            sub.close()


def test_replicas_and_a_killed_member_are_published(decode: Decode) -> None:
    """Scenario: two providers, 10 objects with 2 replicas: 20 BlockStored, one per replica on its
    segment's topic. One provider is killed with -9: once it is declared dead, one BlockRemoved per
    copy it held, on its topic; the objects stay in the pool on the survivor."""
    # a short timeout, for the killed member's death; the survivor heartbeats 15 times within it
    cfg = events_config(heartbeat_timeout_ms=3000)
    with running_meta_service(**cfg) as meta:
        sub = KVEventSubscriber(str(cfg["kv_events_endpoint"]), decode)
        s = joined_store(meta, dram_size="64MB", heartbeat_interval_ms=200)
        victim = StoreProcess(meta, dram_size="64MB")
        try:
            sub.wait_until_subscribed(lambda k: s.put(k, b"p"))
            keys = [f"ns@r-{i}" for i in range(10)]
            assert victim("put", keys=keys, layout=LAYOUT, replicas=2)["codes"] == [0] * 10
            vid = victim("id")["id"]

            def stored_twice() -> bool:
                sub.poll()
                return all(sub.keys("BlockStored").count(k) == 2 for k in keys)
            wait_for(stored_twice, 10, "a BlockStored per replica")
            host = meta.http("/get_all_segments")["segments"][0]["host_id"]
            assert {f"m1|{host}|{vid}".encode(), f"m1|{host}|{s.get_local_service_id()}".encode()} <= sub.topics
            sub.topics.clear()
            victim.kill()

            def removed_once() -> bool:
                sub.poll()
                return all(sub.keys("BlockRemoved").count(k) == 1 for k in keys)
            wait_for(removed_once, 20, "a BlockRemoved per copy the killed member held")
            assert sub.topics == {f"m1|{host}|{vid}".encode()}
            assert s.batch_is_exist(keys) == [1] * 10
        finally:
            victim.stop()
            s.close()
            sub.close()


def test_objects_recovered_after_a_restart_are_published_again(decode: Decode) -> None:
    """A restarted MetaService publishes AllBlocksCleared, then learns the pool's objects from the
    LocalServices that re-join: each one recovered is a BlockStored again. A subscriber that missed
    them (it reconnects after the new MetaService sent them) gets them from the replay socket."""
    cfg = events_config(kv_events_replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    with running_meta_service(**cfg) as meta:
        sub = KVEventSubscriber(str(cfg["kv_events_endpoint"]), decode)
        s = joined_store(meta, heartbeat_interval_ms=500)
        try:
            sub.wait_until_subscribed(lambda k: s.put(k, b"p"))
            keys = [f"ns@kept-{i}" for i in range(5)]
            for k in keys:
                assert s.put(k, b"k" * 5000) == 0

            def published(want: list[str]) -> bool:
                sub.poll()
                return all(k in sub.keys("BlockStored") for k in want)
            wait_for(lambda: published(keys), 10, "BlockStored of the first puts")
            n_objects = meta.metric("commits_total")    # the probes and the keys: nothing was removed
            meta.stop()
            meta.start()                                # same endpoints: the subscriber reconnects by itself
            # The member re-joins as soon as the new MetaService answers, maybe before the SUB socket
            # has reconnected (PUB drops what precedes it): the replay socket has every batch.
            wait_for(lambda: meta.metric("recovered_objects_total") == n_objects
                     and meta.metric("kv_events_published_total") == 1 + n_objects, 20,
                     lambda: f"the recovered objects to be published; log: {meta.log_tail()}")
            sub.events.clear()
            sub.replay(str(cfg["kv_events_replay_endpoint"]), 0)
            assert sub.events[0] == ("AllBlocksCleared", "", None)
            assert sorted(k for k in sub.keys("BlockStored") if k.startswith("ns@")) == keys
            assert s.get("ns@kept-3") == b"k" * 5000
        finally:
            s.close()
            sub.close()


def test_curve_lets_in_only_the_subscribers_it_knows(tmp_path):
    """zmq_enable_curve: a subscriber with an allowed key pair gets the events (and replays); one
    with an unknown key pair, and one speaking plain ZeroMQ, get nothing."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server_pub, server_sec = zmq.auth.create_certificates(str(tmp_path), "server")
    client_pub, client_sec = zmq.auth.create_certificates(str(tmp_path), "router")
    stranger_pub, stranger_sec = zmq.auth.create_certificates(str(tmp_path), "stranger")
    os.replace(client_pub, allowed / "router.key")
    server_key = zmq.auth.load_certificate(server_pub)[0]
    cfg = events_config(kv_events_replay_endpoint=f"tcp://127.0.0.1:{free_port()}", zmq_enable_curve=True,
                        zmq_curve_server_key_file=server_sec, zmq_curve_client_keys_dir=str(allowed))
    with running_meta_service(**cfg) as meta:
        ours = zmq.auth.load_certificate(client_sec)
        theirs = zmq.auth.load_certificate(stranger_sec)
        sub = KVEventSubscriber(str(cfg["kv_events_endpoint"]), raw_decode, (*ours, server_key))  # type: ignore[arg-type]
        stranger = KVEventSubscriber(str(cfg["kv_events_endpoint"]), raw_decode, (*theirs, server_key))  # type: ignore[arg-type]
        plain = KVEventSubscriber(str(cfg["kv_events_endpoint"]), raw_decode)
        s = joined_store(meta)
        try:
            sub.wait_until_subscribed(lambda k: s.put(k, b"p"))
            assert s.put("ns@secret", b"s" * 100) == 0

            def seen() -> bool:
                sub.poll()
                return "ns@secret" in sub.keys("BlockStored")
            wait_for(seen, 10, "the allowed subscriber's event")
            stranger.poll()
            plain.poll()
            assert stranger.events == [] and plain.events == []
            sub.events.clear()
            sub.replay(str(cfg["kv_events_replay_endpoint"]), 0)
            assert "ns@secret" in sub.keys("BlockStored")
            with pytest.raises(AssertionError, match="no end of replay"):
                stranger.replay(str(cfg["kv_events_replay_endpoint"]), 0, timeout_s=1.0)
        finally:
            s.close()
            for x in (sub, stranger, plain):
                x.close()


def test_kv_events_config_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        MetaConfig(kv_events_enable=True, kv_events_endpoint="http://x")
    with pytest.raises(ConfigError, match="kv_events_block_size"):
        MetaConfig(kv_events_block_size=0)
    with pytest.raises(ConfigError, match="kv_events_queue_size"):
        MetaConfig(kv_events_queue_size=0)
    with pytest.raises(ConfigError, match="kv_events_replay_endpoint: must differ"):
        MetaConfig(kv_events_enable=True, kv_events_endpoint="tcp://127.0.0.1:5557",
                   kv_events_replay_endpoint="tcp://127.0.0.1:5557")
    with pytest.raises(ConfigError, match="zmq_curve_server_key_file: needed with zmq_enable_curve"):
        MetaConfig(kv_events_enable=True, zmq_enable_curve=True)
    with pytest.raises(ConfigError, match="zmq_curve_client_keys_dir: .* is not a folder"):
        MetaConfig(kv_events_enable=True, zmq_enable_curve=True, zmq_curve_server_key_file="x",
                   zmq_curve_client_keys_dir=str(tmp_path / "missing"))
