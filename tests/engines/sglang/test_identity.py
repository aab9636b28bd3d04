"""The model part of the namespace (``memcache_sglang.identity``), on real files and SGLang's own
config loader; no server. The end-to-end counterparts are in ``test_namespace.py``."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from memcache_sglang import testing as harness
from memcache_sglang.identity import (
    ModelIdentity,
    checkpoint_files_digest,
    effective_config_digest,
    logical_kv_dtype,
    lora_adapters_digest,
    resolve_checkpoint,
)
from memcache_sglang.keys import KeyScheme, LayoutIdentity

LAYOUT = LayoutIdentity(model="0123456789abcdef", kv_dtype="bfloat16", dtype="bfloat16", storage_format="",
                        layout="page_first_direct", page_size=128, attention="mha", head_sharding="tp1",
                        pp_size=1, attn_cp_size=1, piece_sizes=(65536, 65536))
HASH = "ab" * 32


def model_settings(path: str, overrides: dict | None = None, **kw: object) -> SimpleNamespace:
    """The fields of SGLang's resolved model settings (runtime_context.get_model()) that we read."""
    fields = {"model_path": path, "json_model_override_args": json.dumps(overrides or {}),
              "trust_remote_code": False, "revision": None, "dtype": "auto", "quantization": None,
              "load_format": "auto", "decrypted_config_file": None}
    return SimpleNamespace(**{**fields, **kw})


def test_fp8_variants_do_not_share_a_namespace() -> None:
    """Scenario: fp8_e4m3 and fp8_e5m2 KV caches both store as uint8 in the host pool (what the old
    key recorded) -> the logical dtype keeps their namespaces apart. (The CPU build here refuses
    FP8 KV caches without AMX, and fp8_e5m2 on any CPU, so this is unit level.)"""
    e4m3 = logical_kv_dtype("fp8_e4m3", "uint8")
    e5m2 = logical_kv_dtype("fp8_e5m2", "uint8")
    assert (e4m3, e5m2) == ("fp8_e4m3", "fp8_e5m2")
    a = KeyScheme(dataclasses.replace(LAYOUT, kv_dtype=e4m3, dtype="uint8"), ["r0p0c0"])
    b = KeyScheme(dataclasses.replace(LAYOUT, kv_dtype=e5m2, dtype="uint8"), ["r0p0c0"])
    assert a.namespace != b.namespace and not b.owns(a.kv_keys([HASH])[0])
    assert logical_kv_dtype("auto", "bfloat16") == logical_kv_dtype("bf16", "bfloat16") == "bfloat16"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = Path(harness.ensure_model(sys.executable))
    dst = tmp_path_factory.mktemp("ckpt") / "model"
    shutil.copytree(src, dst)
    return dst


def test_effective_config_digest_sees_overrides(model_dir: Path) -> None:
    """Scenario: --json-model-override-args with a rope override -> another config digest (the
    override is applied by SGLang's own loader); the served model name is not an input at all."""
    plain = effective_config_digest(model_settings(str(model_dir)))
    assert plain == effective_config_digest(model_settings(str(model_dir)))
    rope = effective_config_digest(model_settings(
        str(model_dir), {"rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}}))
    quant = effective_config_digest(model_settings(str(model_dir), quantization="fp8"))
    dtype = effective_config_digest(model_settings(str(model_dir), dtype="float16"))
    assert len({plain, rope, quant, dtype}) == 4


def test_checkpoint_identity_is_the_resolved_path_and_its_files(model_dir: Path, tmp_path: Path) -> None:
    """Scenario: the same checkpoint through a symlink is one identity; a copy elsewhere is another
    checkpoint; a weight file of another size changes the files digest."""
    link = tmp_path / "link"
    link.symlink_to(model_dir)
    assert resolve_checkpoint(str(link), None) == resolve_checkpoint(str(model_dir), None)
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    assert resolve_checkpoint(str(copy), None) != resolve_checkpoint(str(model_dir), None)
    assert checkpoint_files_digest(str(copy)) == checkpoint_files_digest(str(model_dir))
    with open(next(copy.glob("*.safetensors")), "ab") as f:
        f.write(b"\0" * 8)
    assert checkpoint_files_digest(str(copy)) != checkpoint_files_digest(str(model_dir))
    assert resolve_checkpoint("org/not-cached-model", "v1") == "hub:org/not-cached-model@v1"


def test_lora_adapters_are_keyed_by_contents(tmp_path: Path) -> None:
    """Scenario: SGLang ids a start-up adapter by name and path only; new adapter bytes at the same
    name and path -> another namespace."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\1" * 64)
    refs = [f"sql={adapter}"]
    before = lora_adapters_digest(refs)
    assert before == lora_adapters_digest([{"lora_name": "sql", "lora_path": str(adapter)}])
    (adapter / "adapter_model.safetensors").write_bytes(b"\2" * 64)
    assert lora_adapters_digest(refs) != before
    assert lora_adapters_digest(None) == lora_adapters_digest([]) == ""


def test_weight_version_changes_the_model_identity() -> None:
    base = ModelIdentity(checkpoint="path:/m", files="f", config="c", lora="", weights="default")
    assert base.digest() != dataclasses.replace(base, weights="v2").digest()
