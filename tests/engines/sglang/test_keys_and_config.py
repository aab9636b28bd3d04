"""Key scheme and configuration merge of the npu_memcache backend (pure Python, no server)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from memcache_sglang.config import CONFIG_PATH_ENV, BackendConfig, place_disk_tier, rank_index
from memcache_sglang.keys import KeyScheme, LayoutIdentity
from memcache_sglang.pool_join import BackgroundJoin

from memcache_core.config import LocalConfig
from memcache_core.errors import ConfigError

BASE = LayoutIdentity(model="0123456789abcdef", kv_dtype="bfloat16", dtype="bfloat16", storage_format="",
                      layout="page_first_direct", page_size=128, attention="mha", head_sharding="tp1",
                      pp_size=1, attn_cp_size=1, piece_sizes=(131072, 131072))
HASH = "ab" * 32


@pytest.mark.parametrize("change", [
    {"model": "fedcba9876543210"}, {"kv_dtype": "fp8_e4m3"}, {"storage_format": "unified-token-major"},
    {"dtype": "float16"}, {"layout": "page_first"}, {"page_size": 64},
    {"attention": "mla"}, {"head_sharding": "tp2"}, {"head_sharding": "hs2"}, {"pp_size": 2},
    {"attn_cp_size": 2}, {"piece_sizes": (65536, 65536)},
])
def test_every_layout_fact_changes_the_namespace(change: dict) -> None:
    """Scenario: two servers differing in one layout fact never share a key."""
    other = dataclasses.replace(BASE, **change)
    a, b = KeyScheme(BASE, ["r0p0c0"]), KeyScheme(other, ["r0p0c0"])
    assert a.kv_keys([HASH]) != b.kv_keys([HASH])
    assert not b.owns(a.kv_keys([HASH])[0])


def test_keys_of_one_page_and_tag() -> None:
    plain = KeyScheme(BASE, ["r0p0c0", "r1p0c0"])
    tagged = KeyScheme(BASE, ["r0p0c0", "r1p0c0"], tag="tenant-a")
    keys = plain.kv_keys([HASH, "cd" * 32])
    assert len(keys) == 4 and keys[0].endswith(f"{HASH}.r0p0c0") and keys[1].endswith(f"{HASH}.r1p0c0")
    assert tagged.kv_keys([HASH])[0] == "tenant-a:" + plain.kv_keys([HASH])[0]
    assert plain.pool_keys([HASH], "mamba-0a1b2c3d", "r0p0c0")[0].endswith(".r0p0c0.mamba-0a1b2c3d")
    assert all(len(k.encode()) < 256 for k in keys)
    with pytest.raises(ValueError, match="too long"):
        KeyScheme(BASE, ["r0p0c0"], tag="t" * 200)


def test_config_merge_env_file_then_extra_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "memcache.json"
    path.write_text(json.dumps({"dram_size": "1GB", "protocol": "host_tcp", "extra_backend_tag": "file",
                                "metrics_url": "http://127.0.0.1:1"}))
    monkeypatch.setenv(CONFIG_PATH_ENV, str(path))
    cfg = BackendConfig.from_sources({"protocol": "host_shm", "extra_backend_tag": "cli", "prefetch_threshold": 1,
                                      "file_storage_path": "/x", "bogus": 2})
    assert cfg.local_fields == {"dram_size": "1GB", "protocol": "host_shm", "file_storage_path": "/x", "bogus": 2}
    assert cfg.extra_backend_tag == "cli" and cfg.metrics_url == "http://127.0.0.1:1"

    class Local:
        dram_size = protocol = None

    local = Local()
    assert sorted(cfg.apply_to(local)) == ["bogus", "file_storage_path"]
    assert (local.dram_size, local.protocol) == ("1GB", "host_shm")


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read"), ("{protocol: host_shm", "is not valid JSON"), ("[1, 2]", "holds a JSON list, not an object"),
])
def test_config_file_that_cannot_be_used_stops_the_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           content: str | None, message: str) -> None:
    """Scenario: the file named by SGLANG_HICACHE_MEMCACHE_CONFIG_PATH is missing or not a JSON object:
    the backend refuses to start, naming the variable, the file and the remedy, instead of starting on
    the defaults (protocol host_rdma)."""
    path = tmp_path / "memcache.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(CONFIG_PATH_ENV, str(path))
    with pytest.raises(ConfigError, match=f"{CONFIG_PATH_ENV}: .*{message}") as e:
        BackendConfig.from_sources({"dram_size": "2GB"})
    assert str(path) in str(e.value) and "--hicache-storage-backend-extra-config" in str(e.value)


def test_control_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
    assert BackendConfig.from_sources({}).device_id(tp_rank=3, tp_size=4) == 3
    assert BackendConfig.from_sources({"device_id": {"3": 7}}).device_id(3, 4) == 7
    assert BackendConfig.from_sources({"device_id": '{"1": 5}'}).device_id(1, 2) == 5
    assert BackendConfig.from_sources({"device_id": 2}).device_id(0, 1) == 2
    assert BackendConfig.from_sources({"init_bm": "false"}).init_bm is False
    assert BackendConfig.from_sources({}).init_bm is True
    assert BackendConfig.from_sources({}).clear_scope == "namespace"
    assert BackendConfig.from_sources({"clear_scope": "all"}).clear_scope == "all"
    with pytest.raises(ValueError, match="clear_scope"):
        BackendConfig.from_sources({"clear_scope": "everything"})
    assert BackendConfig.from_sources({}).join_retry_max_seconds == 30
    assert BackendConfig.from_sources({"join_retry_max_seconds": "0.5"}).join_retry_max_seconds == 0.5
    for bad in (0, -1, "soon", True, float("inf")):
        with pytest.raises(ConfigError, match=r"^join_retry_max_seconds must be a positive number .* or leave it out"):
            BackendConfig.from_sources({"join_retry_max_seconds": bad})


def test_disk_keys_reach_local_config_one_directory_per_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Scenario: the disk keys in the extra config land on LocalConfig; each rank gets its own directory
    under disk_path; a pure client (no segment to put a tier under) and bad values are refused by name."""
    monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
    extra = {"disk_path": str(tmp_path), "disk_size": "1GB", "disk_write_policy": "write_through", "dram_size": "64MB"}
    cfg = BackendConfig.from_sources(extra)
    local = LocalConfig()
    assert cfg.apply_to(local) == [] and cfg.disk_prefetch is True
    place_disk_tier(local, cfg.init_bm, "r1p0c0")
    assert local.disk_path == str(tmp_path / "r1p0c0") and local.disk_write_policy == "write_through"
    local.validate()
    for bad in ({"init_bm": False}, {"dram_size": "0"}):
        cfg = BackendConfig.from_sources({**extra, **bad})
        local = LocalConfig()
        cfg.apply_to(local)
        with pytest.raises(ValueError, match="^disk_path: .*provider"):
            place_disk_tier(local, cfg.init_bm, "r0p0c0")
    with pytest.raises(ConfigError, match="^disk_prefetch:"):
        BackendConfig.from_sources({"disk_prefetch": "sometimes"})
    assert BackendConfig.from_sources({"disk_prefetch": "false"}).disk_prefetch is False
    local = LocalConfig()
    BackendConfig.from_sources({**extra, "disk_write_policy": "eager"}).apply_to(local)
    with pytest.raises(ConfigError, match="^disk_write_policy:"):
        local.validate()


def test_each_rank_gets_its_own_metrics_port() -> None:
    """Scenario: a server of TP 2 x PP 2 x CP 2 gets one extra config with metrics_port 9100: its
    eight ranks serve on 9100..9107, one each."""
    local = LocalConfig(metrics_port=9100)
    grid = [SimpleNamespace(tp_rank=t, tp_size=2, pp_rank=p, pp_size=2, attn_cp_rank=c)
            for t in range(2) for p in range(2) for c in range(2)]
    assert sorted(local.for_rank(rank_index(sc)).metrics_port for sc in grid) == list(range(9100, 9108))
    assert LocalConfig().for_rank(rank_index(grid[-1])).metrics_port == 0   # off stays off


class RecordedWaits:
    """Stands in for the join thread's stop event: records each wait instead of sleeping."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        return False

    def set(self) -> None:
        pass


@pytest.mark.parametrize(("max_s", "waits"), [(30.0, [1, 2, 4, 8, 16, 30, 30]), (0.5, [0.5] * 7)])
def test_join_backoff_doubles_up_to_its_bound(max_s: float, waits: list[float]) -> None:
    """Scenario: the pool answers at the seventh attempt -> the attempts were 1 s apart at first,
    twice as long after each failure, never more than ``join_retry_max_seconds`` (the bound also
    caps the first wait); the store is handed over once."""
    outcomes = [ConnectionError("down")] * 6 + ["store"]
    joined: list[object] = []

    def open_store() -> object:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    join = BackgroundJoin(open_store, joined.append, max_s=max_s)
    join._stop = RecordedWaits()  # type: ignore[assignment]
    join._run()
    assert join._stop.waits == waits  # type: ignore[attr-defined]
    assert (join.attempts, join.failures, joined) == (7, 6, ["store"]) and join.joined.is_set()
