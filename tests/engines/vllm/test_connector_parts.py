"""The connector's parts without an engine: config, keys, KV layouts and the device staging path,
moving real bytes through a real pool. Seconds, not minutes."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch
from memcache_vllm.config import ConnectorConfig, RolePolicy
from memcache_vllm.keys import MAX_KEY_BYTES, KeySpace, block_hashes_hex
from memcache_vllm.layout import BlockLayout, DeviceStager

from memcache_core import DistributedObjectStore, LocalConfig
from memcache_core.testing import running_meta_service

pytestmark = pytest.mark.engine


def read(ptr: int, size: int) -> bytes:
    return ctypes.string_at(ptr, size)


# -- config ------------------------------------------------------------------------------------

def test_ascend_pool_keys_and_store_keys_are_accepted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    cfg = ConnectorConfig.from_extra_config({
        "backend": "memcache", "lookup_rpc_port": "1", "load_async": "true", "use_layerwise": True,
        "consumer_is_to_put": 1, "consumer_is_to_load": False, "discard_partial_chunks": True,
        "meta_service_url": "tcp://127.0.0.1:5999", "dram_size": "2GB", "protocol": "host_tcp",
        "no_such_key": 1})
    assert cfg.load_async and cfg.consumer_is_to_put and not cfg.use_layerwise
    local = cfg.local_config()
    assert (local.meta_service_url, local.dram_size, local.protocol) == ("tcp://127.0.0.1:5999", "2GB", "host_tcp")
    assert "no_such_key" in caplog.text and "use_layerwise" in caplog.text
    assert ConnectorConfig.from_extra_config({}).local_config().protocol == "host_shm"


@pytest.mark.parametrize("extra, key", [
    ({"load_async": "maybe"}, "load_async"),
    ({"backend": "mooncake"}, "backend"),
    ({"protocol": "carrier_pigeon"}, "protocol"),
    ({"dram_size": "lots"}, "dram_size"),
])
def test_bad_values_fail_naming_the_key(extra: dict, key: str) -> None:
    with pytest.raises(Exception, match=key):
        ConnectorConfig.from_extra_config(extra)


def test_roles() -> None:
    cfg = ConnectorConfig.from_extra_config({})
    assert RolePolicy.from_role("kv_both", cfg) == RolePolicy(True, True)
    assert RolePolicy.from_role("kv_producer", cfg) == RolePolicy(True, True)
    assert RolePolicy.from_role("kv_consumer", cfg) == RolePolicy(False, False)
    both = ConnectorConfig.from_extra_config({"consumer_is_to_load": True, "consumer_is_to_put": True})
    assert RolePolicy.from_role("kv_consumer", both) == RolePolicy(True, True)
    with pytest.raises(ValueError, match="kv_role"):
        RolePolicy.from_role(None, cfg)


# -- keys --------------------------------------------------------------------------------------

def test_namespace_separates_settings_and_ranks() -> None:
    base = KeySpace(model="m", kv_dtype="bfloat16", block_size=32, num_layers=2, num_kv_heads=2,
                    head_size=64, tp_size=2)
    h = ["ab" * 32]
    variants = [base, KeySpace(**{**base.__dict__, "kv_dtype": "float32"}),
                KeySpace(**{**base.__dict__, "block_size": 64}),
                KeySpace(**{**base.__dict__, "num_layers": 3}),
                KeySpace(**{**base.__dict__, "prefix": "tenant-a"})]
    keys = {v.keys(h, 0, 0)[0] for v in variants} | {base.keys(h, 1, 0)[0]}
    assert len(keys) == len(variants) + 1
    assert base.ranks == [(0, 0), (1, 0)]
    long = KeySpace(**{**base.__dict__, "model": "x" * 500, "prefix": "p" * 500})
    assert len(long.keys(h, 0, 0)[0].encode()) <= MAX_KEY_BYTES


def test_block_hashes_at_a_coarser_block_size_use_the_last_sub_hash() -> None:
    hashes = [bytes([i]) * 4 for i in range(6)]
    assert block_hashes_hex(hashes, 0, 3, 1) == [h.hex() for h in hashes[:3]]
    assert block_hashes_hex(hashes, 0, 3, 2) == [hashes[1].hex(), hashes[3].hex(), hashes[5].hex()]


# -- layouts -----------------------------------------------------------------------------------

def test_cpu_layout_is_one_piece_per_layer_per_block() -> None:
    kv = {f"l{i}": torch.randn(10, 2, 32, 128).to(torch.bfloat16) for i in range(3)}
    lay = BlockLayout(kv, 10)
    ptrs, sizes = lay.pieces(4)
    assert sizes == [2 * 32 * 128 * 2] * 3
    assert read(ptrs[1], sizes[1]) == bytes(kv["l1"][4].contiguous().view(torch.uint8).flatten().tolist())


def test_split_kv_layout_is_two_pieces_and_padding_is_refused() -> None:
    kv = {"l0": torch.randn(2, 10, 32, 4, 16)}
    lay = BlockLayout(kv, 10)
    ptrs, sizes = lay.pieces(7)
    assert len(ptrs) == 2 and sizes == [32 * 4 * 16 * 4] * 2
    assert read(ptrs[1], sizes[1]) == bytes(kv["l0"][1, 7].contiguous().view(torch.uint8).flatten().tolist())
    padded = torch.randn(10, 40, 8)[:, :32, :]
    with pytest.raises(ValueError, match="padded"):
        BlockLayout({"l0": padded}, 10)


@pytest.mark.parametrize("shape", [(10, 2, 32, 32), (2, 10, 32, 2, 16)])
def test_staged_objects_equal_in_place_objects(shape: tuple[int, ...]) -> None:
    """Scenario: the staging path (used for device caches) must produce and consume exactly the
    bytes of the in-place path, so instances of both kinds could share a pool."""
    src = torch.randn(*shape).to(torch.bfloat16)
    lay = BlockLayout({"a": src, "b": src * 2}, 10)
    stager = DeviceStager(lay, 4)
    stager.gather([3, 1])
    for slot, block in ((0, 3), (1, 1)):
        staged = b"".join(read(p, n) for p, n in zip(*stager.pieces(slot), strict=True))
        in_place = b"".join(read(p, n) for p, n in zip(*lay.pieces(block), strict=True))
        assert staged == in_place
    dst = torch.zeros(*shape, dtype=torch.bfloat16)
    out = BlockLayout({"a": dst, "b": dst.clone()}, 10)
    st2 = DeviceStager(out, 4)
    st2.buffer.copy_(stager.buffer)
    st2.scatter([5, 6], [0, 1])
    bdim = 0 if shape[0] == 10 else 1
    assert torch.equal(dst.select(bdim, 5), src.select(bdim, 3))
    assert torch.equal(dst.select(bdim, 6), src.select(bdim, 1))


def _pool_roundtrip(device: str) -> None:
    with running_meta_service() as ms:
        cfg = LocalConfig(meta_service_url=ms.meta_service_url, config_store_url=ms.config_store_url,
                          protocol="host_shm", dram_size="64MB")
        store = DistributedObjectStore()
        assert store.setup(cfg) == 0 and store.init(0, init_bm=True) == 0
        try:
            src = torch.randn(8, 2, 32, 4, 16, device=device).to(torch.bfloat16)
            dst = torch.zeros_like(src)
            lay_s, lay_d = BlockLayout({"l": src}, 32), BlockLayout({"l": dst}, 32)
            st_s, st_d = DeviceStager(lay_s, 4), DeviceStager(lay_d, 4)
            for region in (st_s.region(), st_d.region()):
                assert store.register_buffer(*region) == 0
            st_s.gather([2, 9])
            ptrs, sizes = zip(*(st_s.pieces(i) for i in range(2)), strict=True)
            assert store.batch_put_from_layers(["x", "y"], list(ptrs), list(sizes)) == [0, 0]
            ptrs, sizes = zip(*(st_d.pieces(i) for i in range(3)), strict=True)
            codes = store.batch_get_into_layers(["y", "x", "missing"], list(ptrs), list(sizes))
            assert codes[:2] == [0, 0] and codes[2] < 0
            st_d.scatter([20, 21], [0, 1])
            assert torch.equal(dst[:, :, 20], src[:, :, 9]) and torch.equal(dst[:, :, 21], src[:, :, 2])
            assert not dst[:, :, 22].any()
        finally:
            store.close()


def test_staging_path_through_the_pool_on_host() -> None:
    _pool_roundtrip("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_kv_cache_through_the_pool() -> None:
    _pool_roundtrip("cuda")
