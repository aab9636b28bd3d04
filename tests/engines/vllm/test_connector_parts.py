"""The connector's parts without an engine: config, key namespaces (from real vLLM configs), KV
layouts, the load-failure fence and the device staging path, moving real bytes through a real
pool. Seconds, not minutes."""

from __future__ import annotations

import ctypes
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from memcache_vllm.config import ConnectorConfig, RolePolicy
from memcache_vllm.fence import LoadFailureFence
from memcache_vllm.keys import (
    MAX_KEY_BYTES,
    AdapterChanged,
    AdapterDigests,
    Namespace,
    block_hashes_hex,
    block_names,
)
from memcache_vllm.layout import BlockLayout, DeviceStager, layout_signature
from memcache_vllm.metadata import MemCacheWorkerMetadata
from memcache_vllm.poison import PoisonedBlocks, Write

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
    assert cfg.use_layerwise and cfg.consumer_is_to_put and not cfg.load_async   # layer-wise loads are sync
    local = cfg.local_config()
    assert (local.meta_service_url, local.dram_size, local.protocol) == ("tcp://127.0.0.1:5999", "2GB", "host_tcp")
    assert "no_such_key" in caplog.text and "use_layerwise" in caplog.text
    assert ConnectorConfig.from_extra_config({}).local_config().protocol == "host_shm"


@pytest.mark.parametrize("extra, key", [
    ({"load_async": "maybe"}, "load_async"),
    ({"backend": "mooncake"}, "backend"),
    ({"protocol": "carrier_pigeon"}, "protocol"),
    ({"dram_size": "lots"}, "dram_size"),
    ({"disk_path": "/tmp/x", "disk_size": "1GB", "disk_write_policy": "eager"}, "disk_write_policy"),
    ({"disk_path": "/tmp/x"}, "disk_size"),
    ({"disk_path": "/tmp/x", "disk_size": "1GB", "dram_size": "0"}, "disk_path"),
])
def test_bad_values_fail_naming_the_key(extra: dict, key: str) -> None:
    with pytest.raises(Exception, match=key):
        ConnectorConfig.from_extra_config(extra)


def test_config_path_reads_the_pool_file_and_inline_keys_win(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario: the pool's URLs are written once, in the file the MetaService and the providers read;
    the connector reads its store keys from it (``config_path``), the MetaService's keys in it are
    neither used nor warned about, and a key given inline wins over the file's."""
    pool = tmp_path / "pool.json"
    pool.write_text(json.dumps({"meta_service_url": "tcp://10.0.0.1:5000", "config_store_url": "tcp://10.0.0.1:6000",
                                "metrics_url": "http://10.0.0.1:8000", "lease_ttl_ms": 20000, "pool_name": "blue",
                                "protocol": "host_tcp", "dram_size": "8GB", "client_timeout_seconds": 9}))
    monkeypatch.setenv("MEMCACHE_CONFIG_STRICT", "true")
    monkeypatch.setenv("MEMCACHE_HEARTBEAT_INTERVAL_MS", "300")   # an override the file leaves out
    cfg = ConnectorConfig.from_extra_config({"config_path": str(pool), "dram_size": "0", "load_async": True})
    local = cfg.local_config()
    assert (local.meta_service_url, local.config_store_url, local.pool_name, local.protocol,
            local.client_timeout_seconds, local.heartbeat_interval_ms, local.dram_size) == \
        ("tcp://10.0.0.1:5000", "tcp://10.0.0.1:6000", "blue", "host_tcp", 9, 300, "0")
    assert cfg.load_async
    # without the file's keys the connector's own defaults stay
    assert ConnectorConfig.from_extra_config({"config_path": ""}).local_config().protocol == "host_shm"
    for bad, message in ((tmp_path / "missing.json", "config_path: cannot read .*missing.json"),
                         (tmp_path / "bad.json", "config_path: .*not valid JSON")):
        if bad.name == "bad.json":
            bad.write_text("{")
        with pytest.raises(ValueError, match=f"^kv_connector_extra_config.{message}"):
            ConnectorConfig.from_extra_config({"config_path": str(bad)})
    pool.write_text(json.dumps({"dram_szie": "1GB"}))
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config.config_path: .*'dram_szie'.*strict"):
        ConnectorConfig.from_extra_config({"config_path": str(pool)})


def test_disk_keys_give_each_worker_rank_its_own_directory(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra_config({"disk_path": str(tmp_path), "disk_size": "2GB", "dram_size": "64MB",
                                             "disk_write_policy": "write_through"})
    assert cfg.local_config().disk_path == str(tmp_path)
    local = cfg.worker_local_config(tp_rank=1, pp_rank=0)
    assert (local.disk_path, local.disk_size, local.disk_write_policy) == \
        (str(tmp_path / "r1p0"), "2GB", "write_through")
    assert ConnectorConfig.from_extra_config({}).worker_local_config(0, 0).disk_path == ""


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

@pytest.fixture(scope="module")
def vllm_configs(tiny_model: str) -> Callable[..., Any]:
    """Real ``VllmConfig`` objects of the tiny model, as vLLM builds them from engine arguments."""
    from vllm.engine.arg_utils import EngineArgs

    def make(model: str = tiny_model, **kwargs: Any) -> Any:
        args = {"model": model, "block_size": 32, "dtype": "bfloat16", "max_model_len": 4096, **kwargs}
        return EngineArgs(**args).create_engine_config()

    return make


LAYOUT = "CPU_ATTN|LBHNC|bfloat16[B,2,32,128]order0123"


def head(cfg: Any, prefix: str = "", layout: str = LAYOUT) -> str:
    return Namespace.build(cfg, 32, prefix, layout).rank_prefix("0", 0, 0)


def test_namespace_names_the_checkpoint_not_its_name(vllm_configs, tiny_model: str,
                                                     tmp_path: Path) -> None:
    """Scenario (issue 15, item 3): two checkpoints in directories with the same last name, or a
    checkpoint served under another name, are told apart by the resolved directory; the same
    directory reached through a symlink is the same checkpoint."""
    other = tmp_path / "b" / Path(tiny_model).name
    shutil.copytree(tiny_model, other)
    link = tmp_path / "link"
    link.symlink_to(tiny_model)
    base = head(vllm_configs())
    assert head(vllm_configs(model=str(other))) != base
    # The label (last path part, for people) differs; the identity does not.
    assert Namespace.build(vllm_configs(model=str(link)), 32, "", LAYOUT).factors_digest == \
        Namespace.build(vllm_configs(), 32, "", LAYOUT).factors_digest
    assert head(vllm_configs(served_model_name=["someone-else"])) == base
    assert Path(tiny_model).name[:20] in base, "the readable label stays"


def test_namespace_names_the_checkpoint_by_its_content(vllm_configs, tiny_model: str,
                                                       tmp_path: Path) -> None:
    """Scenario (issue 21, item 3): other weights of the same shape written over the checkpoint's
    file at one path (same name, size and safetensors header; a new modification time) give
    another namespace; with weights_full_hash the bytes decide (a copy with new times is the same
    checkpoint, other bytes with the old time put back are not)."""
    import os

    swap = tmp_path / "model"
    shutil.copytree(tiny_model, swap)
    cfg = vllm_configs(model=str(swap))
    before = Namespace.build(cfg, 32, "", LAYOUT)
    before_full = Namespace.build(cfg, 32, "", LAYOUT, weights_full_hash=True)
    weights = next(swap.glob("*.safetensors"))
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # the last tensor's last bytes: same size, same header
    weights.write_bytes(bytes(data))
    assert Namespace.build(cfg, 32, "", LAYOUT).head != before.head
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert Namespace.build(cfg, 32, "", LAYOUT).head == before.head, "stat and header only"
    assert Namespace.build(cfg, 32, "", LAYOUT, weights_full_hash=True).head != before_full.head


def test_prefill_context_parallel_ranks_have_their_own_keys() -> None:
    """Scenario (issue 21, item 4): ranks of prefill context parallelism that share a TP and a PP
    rank hold other token shards of each block: each has its own key; with PCP 1 keys are as
    before (no pcp part)."""
    ns = Namespace(label="m", tenant="", factors_digest="d" * 64, tp_size=2, pp_size=1, pcp_size=2)
    assert ns.ranks == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]
    keys = {k for rank in ns.ranks for k in ns.keys("0", ["ab"], *rank)}
    assert len(keys) == 4
    assert "@pcp1of2@" in ns.rank_prefix("0", 0, 0, 1)
    one = Namespace(label="m", tenant="", factors_digest="d" * 64, tp_size=2)
    assert one.rank_prefix("0", 1, 0) == "mc@m@" + "d" * 20 + "@e0@tp1of2@pp0of1@"


def test_namespace_covers_settings_that_change_kv_bytes(vllm_configs) -> None:
    """Scenario (items 4 and 6): rope overrides, the model dtype, the KV-cache dtype (each fp8
    variant apart) and the block size each give another namespace; settings that never change a
    block's bytes (max_model_len, seed) do not."""
    base = head(vllm_configs())
    rope = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    variants = {
        "rope override": head(vllm_configs(hf_overrides=rope)),
        "sliding window off": head(vllm_configs(disable_sliding_window=True)),
        "float32": head(vllm_configs(dtype="float32")),
        "fp8_e4m3": head(vllm_configs(kv_cache_dtype="fp8_e4m3")),
        "fp8_e5m2": head(vllm_configs(kv_cache_dtype="fp8_e5m2")),
    }
    assert base not in variants.values()
    assert len(set(variants.values())) == len(variants), variants
    assert Namespace.build(vllm_configs(), 64, "", LAYOUT).head != Namespace.build(
        vllm_configs(), 32, "", LAYOUT).head
    assert head(vllm_configs(max_model_len=1024, seed=7)) == base
    assert head(vllm_configs(kv_cache_dtype="bfloat16")) == base, "auto is the model dtype"


def test_speculative_decoding_is_part_of_the_namespace(vllm_configs, tiny_model: str) -> None:
    """Scenario (issue 21, item 4): an instance with speculative decoding (a draft model, whose
    layers add to the KV cache, or n-gram lookup) and one without get other namespaces, and two
    speculative configs differ from each other; the same config twice is the same namespace."""
    base = head(vllm_configs())
    draft = {"model": tiny_model, "num_speculative_tokens": 2}
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with_draft = head(vllm_configs(speculative_config=draft))
    with_ngram = head(vllm_configs(speculative_config=ngram))
    assert len({base, with_draft, with_ngram}) == 3
    assert head(vllm_configs(speculative_config={**draft, "num_speculative_tokens": 3})) != with_draft
    assert head(vllm_configs(speculative_config=dict(draft))) == with_draft


def test_kv_cache_dtype_auto_is_the_model_dtype(vllm_configs) -> None:
    """Scenario (issue 21, item 4): ``--kv-cache-dtype auto`` and the model's own dtype named
    explicitly store the same bytes and share a namespace; another dtype does not."""
    for dtype in ("bfloat16", "float16"):
        auto = head(vllm_configs(dtype=dtype, kv_cache_dtype="auto"))
        assert head(vllm_configs(dtype=dtype, kv_cache_dtype=dtype)) == auto
        assert head(vllm_configs(dtype=dtype, kv_cache_dtype="fp8_e4m3")) != auto
    assert head(vllm_configs(dtype="float16")) != head(vllm_configs(dtype="bfloat16"))


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny DeepSeek-V2 config (multi-head latent attention); a config is all vLLM needs to build
    its ``VllmConfig`` (no weights, no tokenizer)."""
    out = tmp_path_factory.mktemp("tiny-deepseek-v2")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 32000,
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "first_k_dense_replace": 2, "kv_lora_rank": 64, "q_lora_rank": None,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_nope_head_dim": 32, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}))
    return str(out)


def test_mla_tensor_parallel_ranks_share_one_copy(vllm_configs, mla_model: str) -> None:
    """Scenario (issue 21, item 4): with MLA every TP rank holds the same latent KV, so a block is
    stored once: with TP 2 the keys have no TP rank (the same for both ranks), only rank 0 saves,
    and a lookup asks for that one key. The negative control: a non-MLA model of TP 2 keeps one key
    per rank, both saved and both looked up."""
    mla = Namespace.build(vllm_configs(model=mla_model, skip_tokenizer_init=True, block_size=16,
                                       tensor_parallel_size=2), 16, "", LAYOUT)
    assert mla.tp_shared and mla.tp_size == 2
    assert mla.ranks == [(0, 0, 0)]
    assert mla.keys("0", ["ab"], 0, 0) == mla.keys("0", ["ab"], 1, 0)
    assert "@tpallof2@" in mla.rank_prefix("0", 1, 0)
    assert [mla.saves(r) for r in range(2)] == [True, False]
    mha = Namespace.build(vllm_configs(tensor_parallel_size=2), 32, "", LAYOUT)
    assert not mha.tp_shared
    assert mha.ranks == [(0, 0, 0), (1, 0, 0)]
    assert mha.keys("0", ["ab"], 0, 0) != mha.keys("0", ["ab"], 1, 0)
    assert [mha.saves(r) for r in range(2)] == [True, True]
    one = Namespace.build(vllm_configs(model=mla_model, skip_tokenizer_init=True, block_size=16), 16, "", LAYOUT)
    assert one.factors_digest != mla.factors_digest, "the TP size stays in the namespace"


def test_tenant_prefix_is_identity_in_full(vllm_configs) -> None:
    """Scenario (item 8): cache_prefix values that sanitize or truncate to the same text are
    still different tenants."""
    cfg = vllm_configs()
    assert head(cfg, "tenant/a") != head(cfg, "tenant_a")
    long_a, long_b = "t" * 40 + "a", "t" * 40 + "b"
    assert head(cfg, long_a) != head(cfg, long_b)
    assert head(cfg, "tenant/a") == head(cfg, "tenant/a")
    ns = Namespace.build(cfg, 32, "p" * 500, LAYOUT)
    names = block_names(["ab" * 32], "f" * 16)
    assert len(ns.keys("f" * 16, names, 7, 3)[0].encode()) <= MAX_KEY_BYTES


def _per_layer_view(layout: Any, logical: tuple[int, ...]) -> torch.Tensor:
    """A per-layer KV view of logical shape [B, H, N, C] laid out in memory as ``layout``."""
    order = layout.layer_view_order
    physical = torch.empty([logical[d] for d in order], dtype=torch.bfloat16)
    inverse = [order.index(d) for d in range(len(order))]
    return physical.permute(*inverse)


@pytest.mark.parametrize("heads, block", [(8, 16), (16, 16)])
def test_block_byte_order_of_the_backend_is_keyed(vllm_configs, heads: int, block: int) -> None:
    """Scenario (item 9): two instances whose attention backends lay a block out as [H, N, C]
    (HND) and [N, H, C] (NHD) hold a block's bytes in a different order; their keys differ, also
    when the head count equals the block size (equal shapes). Equal layouts give equal keys."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    logical = (10, heads, block, 128)
    hnd = {f"l{i}": _per_layer_view(KVCacheLayout.LBHNC, logical) for i in range(2)}
    nhd = {f"l{i}": _per_layer_view(KVCacheLayout.LBNHC, logical) for i in range(2)}
    assert hnd["l0"].shape == nhd["l0"].shape
    sig_hnd = layout_signature(hnd, 10, ["FLASH_ATTN"], "LBHNC")
    sig_nhd = layout_signature(nhd, 10, ["FLASH_ATTN"], "LBNHC")
    assert sig_hnd != sig_nhd
    # The tensors alone tell the orders apart, even if both backends claimed the same layout name.
    assert layout_signature(hnd, 10, ["X"], None) != layout_signature(nhd, 10, ["X"], None)
    again = {"l0": _per_layer_view(KVCacheLayout.LBHNC, logical)}
    assert layout_signature(again, 10, ["FLASH_ATTN"], "LBHNC") == sig_hnd
    cfg = vllm_configs()
    assert head(cfg, layout=sig_hnd) != head(cfg, layout=sig_nhd)
    # Each layout is still moved as whole, contiguous blocks.
    for kv in (hnd, nhd):
        assert BlockLayout(kv, 10).pieces_per_block == 2


def test_lora_adapter_is_keyed_by_what_was_loaded(tmp_path: Path) -> None:
    """Scenario (issue 21, item 2): vLLM's block hash carries a LoRA adapter's name and path only;
    the connector adds a digest of the adapter's files taken when the engine loaded it. The files
    are then replaced on disk while the engine still serves the loaded adapter: the adapter has no
    blocks (AdapterChanged: neither lookups nor saves) until a request reloads it
    (load_inplace), and from then on the new contents' digest."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\x01" * 1000)
    digests = AdapterDigests()
    first = digests.tag(1, str(adapter))
    assert digests.tag(1, str(adapter)) == first
    (adapter / "adapter_model.safetensors").write_bytes(b"\x02" * 1001)
    with pytest.raises(AdapterChanged):
        digests.tag(1, str(adapter))
    reloaded = digests.tag(1, str(adapter), reload=True)
    assert reloaded != first and digests.tag(1, str(adapter)) == reloaded
    assert digests.tag(2, str(adapter)) == reloaded, "the digest names contents, not the id"
    assert block_names(["ab"], None) == ["ab"]
    assert block_names(["ab"], first) == [f"ab.l{first}"]
    with pytest.raises(FileNotFoundError):
        digests.tag(3, str(tmp_path / "empty-dir-that-does-not-exist"))


# -- the load-failure fence --------------------------------------------------------------------

def test_fence_sync_scheduling() -> None:
    """Scenario (item 1): step N's load fails for blocks 5 and 6. A save in step N whose request
    read block 6 (shared through the local prefix cache) is fenced, one that read neither is not.
    The scheduler acknowledges epoch 1 in step N+1's metadata (after vLLM rescheduled the
    requests): from then on the recomputed blocks may be saved."""
    fence = LoadFailureFence()
    assert fence.fail([5, 6]) == 1
    assert fence.fenced([0, 1, 6, 9]) and not fence.fenced([0, 1, 2])
    assert fence.take_report() == 1 and fence.take_report() is None
    fence.acknowledge(1)
    assert not fence.fenced([0, 1, 6, 9]) and len(fence) == 0


def test_fence_async_scheduling_keeps_the_in_flight_step_fenced() -> None:
    """Scenario (item 1, async scheduling): step N+1 was scheduled before step N's failure was
    handled; its metadata carries no acknowledgement, so its saves over the failed block stay
    fenced. A second failure (epoch 2) in step N+1 stays fenced when step N+2 acknowledges only
    epoch 1."""
    fence = LoadFailureFence()
    fence.fail([5])
    assert fence.take_report() == 1
    # step N+1: no acknowledgement yet
    assert fence.fenced([5, 7])
    fence.fail([8])
    assert fence.take_report() == 2
    # step N+2: the scheduler has handled epoch 1 only
    fence.acknowledge(1)
    assert not fence.fenced([5, 7]) and fence.fenced([8])
    fence.acknowledge(2)
    assert not fence.fenced([8])


# -- poisoned blocks (scheduler side) ------------------------------------------------------------

def test_poison_spreads_down_the_chain_and_clears_when_rewritten() -> None:
    """Scenario (issue 21, item 1): request A holds blocks [10..15]; blocks 13 and 14 did not load.
    13, 14 and 15 (computed over them) are poisoned, and so is C's block 30 (C shares A's first
    four blocks through the local prefix cache and computed block 30 after them). A is then
    aborted before recomputing: C, whose context still holds block 13, computes block 31 over
    it (poisoned too). A block freed and given to another request is clean once rewritten in full
    over a clean context."""
    p = PoisonedBlocks(block_size=4)
    a, c = [10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 30]
    assert p.failed({13, 14}, [a, c]) == {13, 14, 15, 30}
    assert p.any([10, 11, 13]) and not p.any([10, 11, 12])
    assert p.step([Write(c + [31], 20, 24)]) == {31}
    # block 14 reused by another request, rewritten from its first token over clean blocks
    assert p.step([Write([40, 41, 14], 8, 12)]) == set()
    assert 14 not in p and 13 in p


def test_poison_cleared_by_a_recompute_in_the_same_step_as_its_readers() -> None:
    """Scenario: vLLM reschedules A (truncated to its first failed block, 3) and B, which shares
    A's blocks and was reverted to its own tokens; both run in one step. A rewrites blocks 13..15
    over its clean first three; B reads them in that same forward (every layer writes before it
    reads), so B's blocks are clean too. A chunked rewrite that stops half-way through a block
    leaves the rest of the block poisoned until the next chunk."""
    p = PoisonedBlocks(block_size=4)
    a, b = [10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 14, 15, 20, 21]
    p.failed({13}, [a, b])
    assert p.step([Write(b, 24, 32), Write(a, 12, 24)]) == set()
    assert len(p) == 0
    p.failed({13}, [a])
    assert p.step([Write(a, 12, 14)]) == set() and 13 in p
    assert p.step([Write(a, 14, 24)]) == set() and len(p) == 0


def test_poison_clears_on_load_and_never_on_a_write_over_poison() -> None:
    """Scenario: a block that a load rewrites is clean (a failure would report it again); a block
    rewritten by a request whose earlier blocks are poisoned stays poisoned, and is returned again
    (vLLM cached it anew when it allocated it for this step). A block nobody holds is forgotten."""
    p = PoisonedBlocks(block_size=4)
    p.failed({5}, [[5, 6]])
    p.loaded([5])
    assert 5 not in p and 6 in p
    p.failed({5}, [])
    assert p.step([Write([5, 6], 4, 8)]) == {6} and p.any([6]), "written again over poison: evict again"
    p.forget(lambda b: b != 6)
    assert len(p) == 1 and 5 in p


def test_worker_metadata_aggregates_ranks() -> None:
    a = MemCacheWorkerMetadata({(0, 0): 2})
    a.aggregate(MemCacheWorkerMetadata({(1, 0): 1, (0, 0): 1}))
    assert a.failure_epochs == {(0, 0): 2, (1, 0): 1}


def test_worker_metadata_aggregates_saved_keys() -> None:
    a = MemCacheWorkerMetadata({}, ["k0"], [])
    a.aggregate(MemCacheWorkerMetadata({}, ["k1"], ["k2"]))
    assert (a.saved_keys, a.unsaved_keys) == (["k0", "k1"], ["k2"])


def events_request(n_tokens: int) -> Any:
    """A real vLLM request whose block hashes vLLM computed (sha256, every 16 tokens)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request("r", list(range(100, 100 + n_tokens)), SamplingParams(), None,
                   block_hasher=get_request_block_hasher(16, hash_fn))


def test_pool_events_announce_a_block_once_every_rank_saved_it() -> None:
    """Scenario: blocks 0 and 1 of a request (32-token blocks over vLLM's 16-token hashes) are saved
    by two ranks. Block 0 is announced once both ranks' keys are saved, once even when saved again;
    block 1, which one rank failed to save, never; a block the connector removes before its save
    ends is not announced; announced blocks a lookup finds gone are announced removed, once."""
    from memcache_vllm.events import PoolEvents
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    req = events_request(100)
    ev = PoolEvents(True, 32, 2)
    ev.saves_issued(req, 0, ["b0", "b1"], [["t0/b0", "t1/b0"], ["t0/b1", "t1/b1"]])
    ev.saves_done(["t0/b0", "t0/b1"], [])
    assert ev.take() == [], "announced before every rank saved it"
    ev.saves_done(["t1/b0"], ["t1/b1"])
    (stored,) = ev.take()
    assert isinstance(stored, BlockStored) and stored.medium == MEDIUM_CPU and stored.block_size == 32
    assert stored.block_hashes == [maybe_convert_block_hash(req.block_hashes[1])]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(100, 132))
    ev.saves_issued(req, 0, ["b0"], [["t0/b0", "t1/b0"]])
    ev.saves_done(["t0/b0", "t1/b0", "t1/b1"], [])
    assert ev.take() == [], "announced twice, or after a rank failed to save it"
    ev.saves_issued(req, 2, ["b2"], [["t0/b2", "t1/b2"]])
    ev.removed(["b2"])
    ev.saves_done(["t0/b2", "t1/b2"], [])
    assert ev.take() == [], "a block removed before its save ended was announced"
    ev.saves_issued(req, 1, ["b1"], [["t0/b1", "t1/b1"]])
    ev.saves_done(["t0/b1", "t1/b1"], [])
    (second,) = ev.take()
    assert second.parent_block_hash == stored.block_hashes[0] and second.token_ids == list(range(132, 164))
    ev.gone(["b0", "b1", "b9"])
    ev.gone(["b0"])
    assert ev.take() == [BlockRemoved(block_hashes=stored.block_hashes + second.block_hashes, medium=MEDIUM_CPU)]
    ev.saves_issued(req, 0, ["b0"], [["t0/b0", "t1/b0"]])
    ev.saves_done(["t0/b0", "t1/b0"], [])
    ev.saves_issued(req, 1, ["b1"], [["t0/b1", "t1/b1"]])
    assert ev.take() == [stored], "a block gone from the pool is announced again when saved again"
    ev.cleared()   # reset_cache
    ev.saves_done(["t0/b1", "t1/b1"], [])
    assert ev.take() == [BlockRemoved(block_hashes=stored.block_hashes, medium=MEDIUM_CPU)]


def test_pool_events_are_off_without_vllm_kv_events() -> None:
    from memcache_vllm.events import PoolEvents

    ev = PoolEvents(False, 16, 1)
    ev.saves_issued(events_request(40), 0, ["b0"], [["k"]])
    ev.saves_done(["k"], [])
    assert ev.take() == []


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
