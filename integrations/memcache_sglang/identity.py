"""What a server's KV bytes depend on besides the tokens: the model part of the key namespace.

SGLang's page hashes say which tokens (and, through ``extra_key``, which LoRA adapter id); they do
not say which weights and which model configuration computed the KV. Two servers share pool
objects only when all of these agree (:class:`ModelIdentity`):

* ``checkpoint`` - where the weights come from: the resolved local directory (``realpath``), or
  the hub id plus the revision (the snapshot's commit when the local hub cache resolves it).
  SGLang's ``--served-model-name`` is a label and never enters.
* ``files`` - the checkpoint's content identity, taken when the weights are loaded (at start-up
  and after each weight update): the config/index files' bytes and every weight file by its hub
  blob hash, or its size, modification time and safetensors header (``weights_full_hash``: the
  SHA-256 of its bytes; see :mod:`memcache_core.checkpoint`). Other weights replaced in place at
  the same path are another model from the next load on.
* ``config`` - a digest of the *effective* model configuration, as SGLang loads it: the HF config
  with ``--json-model-override-args`` applied (rope scaling, window, ...), plus the SGLang
  settings that change the computed KV: ``--dtype``, ``--quantization``, ``--revision``, the
  load format and the extra config file.
* ``lora`` - a digest of the contents of the adapters given at start-up (``--lora-paths``): SGLang
  seeds their pages' hashes with an id made from the adapter's name and path only.
* ``weights`` - the weight version (:mod:`memcache_sglang.weight_updates`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memcache_core.checkpoint import manifest_digest

logger = logging.getLogger(__name__)

LORA_HASH_CHUNK = 1 << 20


def _digest(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class ModelIdentity:
    """Everything besides the layout that decides a page's KV bytes; hashed into the namespace."""

    checkpoint: str
    files: str
    config: str
    lora: str
    weights: str

    def digest(self) -> str:
        return _digest(asdict(self))


def resolve_checkpoint(model_path: str, revision: str | None) -> str:
    """``path:{realpath}`` for a local directory, else ``hub:{id}@{commit or revision}``."""
    if os.path.isdir(model_path):
        return f"path:{os.path.realpath(model_path)}"
    commit = None
    try:
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(model_path, revision=revision, local_files_only=True)
        commit = Path(snapshot).name
    except Exception as exc:  # not in the local hub cache, or no huggingface_hub
        logger.warning("cannot resolve %s@%s to a commit from the local hub cache (%s); the namespace "
                       "uses the revision as given", model_path, revision or "default", exc)
    return f"hub:{model_path}@{commit or revision or 'default'}"


def checkpoint_files_digest(model_path: str, full: bool = False) -> str:
    """The checkpoint's content identity (:func:`memcache_core.checkpoint.manifest_digest`):
    config/index bytes, and every weight file by its hub blob hash, or its size, modification
    time and safetensors header (``full``: the SHA-256 of its bytes)."""
    if not Path(model_path).is_dir():
        return "remote"
    try:
        return manifest_digest(model_path, full)
    except FileNotFoundError:
        return "empty"


def effective_config_digest(model: Any) -> str:
    """Digest of the HF config as SGLang loads it (overrides applied) and the KV-relevant settings.

    ``model`` is SGLang's resolved model settings (``runtime_context.get_model()``). ``get_config``
    is the loader SGLang's own ``ModelConfig`` uses (cached, so this is the same object).
    """
    from sglang.srt.utils.hf_transformers.config import get_config

    overrides = json.loads(model.json_model_override_args or "{}")
    kwargs = {}
    if getattr(model, "decrypted_config_file", None):
        kwargs["_configuration_file"] = model.decrypted_config_file.strip()
    hf_config = get_config(model.model_path, trust_remote_code=model.trust_remote_code,
                           revision=model.revision, model_override_args=overrides, **kwargs)
    settings = {
        "hf_config": hf_config.to_dict(),
        "overrides": overrides,
        "dtype": model.dtype,
        "quantization": model.quantization,
        "revision": model.revision,
        "load_format": str(model.load_format),
    }
    return _digest(settings)


def logical_kv_dtype(kv_cache_dtype: str | None, storage_dtype: str) -> str:
    """The KV dtype as SGLang means it, not as the host pool stores it: ``fp8_e4m3`` and
    ``fp8_e5m2`` both store as ``uint8`` and must not share objects.

    ``--kv-cache-dtype auto`` keeps the model's dtype, which is the storage dtype (an FP8 KV cache
    chosen by the checkpoint's quantization config is told apart by the config digest).
    """
    requested = (kv_cache_dtype or "auto").strip().lower()
    if requested == "auto":
        return storage_dtype
    if requested in ("bf16", "bfloat16"):
        return "bfloat16"
    return requested


def _lora_ref_fields(ref: Any) -> tuple[str, str]:
    if isinstance(ref, dict):
        return str(ref.get("lora_name")), str(ref.get("lora_path"))
    if isinstance(ref, str):
        name, _, path = ref.partition("=")
        return (name, path) if path else (ref, ref)
    return str(getattr(ref, "lora_name", "")), str(getattr(ref, "lora_path", ""))


def lora_adapters_digest(lora_paths: Any) -> str:
    """Digest of the start-up adapters: name, path and the bytes of every file of the adapter.

    SGLang keys a start-up adapter's pages by an id made of its name and path; two servers whose
    adapter files at the same path differ would otherwise share pages. Adapters loaded later
    through ``/load_lora_adapter`` get a random id per load and so never share pages.
    """
    if not lora_paths:
        return ""
    refs = lora_paths.items() if isinstance(lora_paths, dict) else [_lora_ref_fields(r) for r in lora_paths]
    entries = []
    for name, path in sorted(refs):
        root = Path(path)
        if not root.is_dir():
            logger.warning("LoRA adapter %s (%s) is not a local directory; its contents cannot be "
                           "hashed and only its name and path enter the namespace", name, path)
            entries.append([name, path, "remote"])
            continue
        h = hashlib.sha256()
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            h.update(str(file.relative_to(root)).encode() + b"\0")
            with open(file, "rb") as f:
                while chunk := f.read(LORA_HASH_CHUNK):
                    h.update(chunk)
        entries.append([name, os.path.realpath(path), h.hexdigest()])
    return _digest(entries)
