"""KV events of a real MetaService, seen by a real ZeroMQ SUB socket: put, remove and eviction."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from memcache_core import DistributedObjectStore
from memcache_core.config import MetaConfig
from memcache_core.errors import ConfigError
from memcache_core.testing import free_port, running_meta_service, wait_for

pytestmark = pytest.mark.integration


class Events:
    """A subscriber that decodes frames without our structs: the raw msgpack is the contract."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.stored: list[str] = []
        self.removed: list[str] = []
        self.topics: set[bytes] = set()
        self.seqs: list[int] = []

    def poll(self) -> None:
        while self.sock.poll(50):
            topic, seq, payload = self.sock.recv_multipart()
            self.topics.add(topic)
            self.seqs.append(int.from_bytes(seq, "big"))
            ts, events = msgspec.msgpack.decode(payload)[:2]
            assert isinstance(ts, float)
            for ev in events:
                if ev[0] == "BlockStored":
                    tag, hashes, parent, tokens, block_size, lora, medium = ev
                    assert parent is None and tokens == [] and block_size == 32 and lora is None
                    self.stored += [h.decode() for h in hashes]
                else:
                    tag, hashes, medium = ev
                    assert tag == "BlockRemoved"
                    self.removed += [h.decode() for h in hashes]
                assert medium == "DRAM"

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def test_put_remove_and_eviction_are_published():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with running_meta_service(kv_events_enable=True, kv_events_endpoint=endpoint, kv_events_model_name="m1",
                              kv_events_block_size=32, heartbeat_timeout_ms=1500) as meta:
        sub = Events(endpoint)
        s = DistributedObjectStore()
        assert s.setup(meta.local_config(dram_size="8MB")) == 0 and s.init(0, True) == 0
        try:
            n = [0]

            def joined() -> bool:   # PUB drops what is sent before the subscription reaches it
                assert s.put(f"probe-{n[0]}", b"p") == 0
                n[0] += 1
                sub.poll()
                return bool(sub.stored)
            wait_for(joined, 10, "the subscriber to see a first BlockStored")
            assert s.put("ns@block-1", b"x" * 1000) == 0
            assert s.remove("ns@block-1") == 0
            for i in range(40):                  # 40 x 400 KB into 8 MB: LRU eviction
                assert s.put(f"ns@fill-{i}", b"f" * 400_000) == 0
            evictions = meta.http("/metrics/summary")["evictions"]
            assert evictions > 0

            def all_removed() -> bool:
                sub.poll()
                return len(sub.removed) == evictions + 1
            wait_for(all_removed, 10, "one BlockRemoved for the removal and one per eviction")
            assert "ns@block-1" in sub.removed and any(k.startswith("ns@fill-") for k in sub.removed)
            assert "ns@block-1" in sub.stored and sum(k.startswith("ns@fill-") for k in sub.stored) == 40
            assert sub.topics == {f"m1|{h}|{s.get_local_service_id()}".encode()
                                  for h in [meta.http("/get_all_segments")["segments"][0]["host_id"]]}
            assert sub.seqs == sorted(sub.seqs)
            metrics = meta.http("/metrics")
            assert "memcache_kv_events_dropped_total 0.0" in metrics
        finally:
            s.close()
            sub.close()


def test_kv_events_config_is_validated():
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        MetaConfig(kv_events_enable=True, kv_events_endpoint="http://x")
    with pytest.raises(ConfigError, match="kv_events_block_size"):
        MetaConfig(kv_events_block_size=0)
    with pytest.raises(ConfigError, match="kv_events_queue_size"):
        MetaConfig(kv_events_queue_size=0)


def test_objects_recovered_after_a_restart_are_published_again():
    """A restarted MetaService learns the pool's objects from the LocalServices that re-join: each
    one recovered is a BlockStored again, so a router that follows the events (and saw the pool go
    quiet) learns they are there."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with running_meta_service(kv_events_enable=True, kv_events_endpoint=endpoint, kv_events_model_name="m1",
                              kv_events_block_size=32, heartbeat_timeout_ms=1500) as meta:
        sub = Events(endpoint)
        s = DistributedObjectStore()
        assert s.setup(meta.local_config(dram_size="8MB", heartbeat_interval_ms=500)) == 0 and s.init(0, True) == 0
        try:
            n = [0]

            def joined() -> bool:
                assert s.put(f"probe-{n[0]}", b"p") == 0
                n[0] += 1
                sub.poll()
                return bool(sub.stored)
            wait_for(joined, 10, "the subscriber to see a first BlockStored")
            keys = [f"ns@kept-{i}" for i in range(5)]
            for k in keys:
                assert s.put(k, b"k" * 5000) == 0

            def published(want: list[str]) -> bool:
                sub.poll()
                return all(k in sub.stored for k in want)
            wait_for(lambda: published(keys), 10, "BlockStored of the first puts")
            meta.stop()
            sub.stored.clear()
            meta.start()                                # same endpoints: the subscriber reconnects by itself
            wait_for(lambda: published(keys), 20, "BlockStored of the recovered objects")
            assert sorted(k for k in sub.stored if k.startswith("ns@")) == keys
            assert s.get("ns@kept-3") == b"k" * 5000
        finally:
            s.close()
            sub.close()
