"""Pool keys for vLLM KV blocks: a namespace that names the bytes.

A key names one block of one rank, all layers of that rank:

    mc@<tenant>@<label>@<namespace digest>@e<epoch>@tp<r>of<n>@pp<r>of<n>[@pcp<r>of<n>]@<block name>

(``pcp``: prefill context parallelism, only when its size is above 1: ranks that share a TP and
PP rank hold other token shards of each block.) With MLA every TP rank holds the same latent KV of a
block, so the key has no TP rank (``tpallof<n>``): TP rank 0 saves the one copy and every TP rank
loads it (``Namespace.tp_shared``).

* ``<block name>`` is vLLM's chained block hash in hex (it identifies the whole token prefix up
  to and including the block, plus LoRA name and path, cache salt and multimodal inputs), followed
  by ``.l<digest>`` of the LoRA adapter's files as the engine loaded them (``AdapterDigests``;
  vLLM hashes only the adapter's name and path, not its contents).
* ``<namespace digest>`` is a SHA-256 over everything else that decides the bytes of a block
  (``Namespace.factors``): the checkpoint's identity (resolved directory and the content digest
  of its files, taken once when the worker has loaded them; or hub id and resolved revision), the effective model config after ``hf_overrides`` (rope, window, ...), model dtype,
  quantization, the logical KV-cache dtype, block size, KV shape, the KV-cache layout the workers
  really hold (attention backend, resolved stride order, tensor shapes and strides), the
  speculative-decoding method and draft model, the block
  hash algorithm, the device type, the parallel layout (TP, PP, prefill and decode context
  parallel sizes) and the full ``cache_prefix``.
* ``<tenant>`` (the ``cache_prefix``, sanitized, at most 32 characters) and ``<label>`` (the last
  part of the model path, at most 32 characters) are for people reading keys; they are not
  identity (the digest is). A served model name never enters the key.
* ``<epoch>`` is ``0`` until ``reset_cache``; each reset draws a new random epoch, so the instance
  never again reads a block written before the reset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memcache_core.checkpoint import manifest_digest

logger = logging.getLogger("vllm." + __name__)

MAX_KEY_BYTES = 255
_UNSAFE = re.compile(r"[^A-Za-z0-9._\-]")
# Keys of a HF config that name where it was read from, not what it computes.
_CONFIG_NOISE = ("_name_or_path", "name_or_path", "_commit_hash", "transformers_version")


def _sanitize(text: str, limit: int) -> str:
    return _UNSAFE.sub("_", text)[:limit]


def checkpoint_identity(model: str, revision: str | None, full_hash: bool = False) -> str:
    """What names the weights: a local directory by its resolved path and its content
    (:func:`memcache_core.checkpoint.manifest_digest`, taken once, when the worker has loaded the
    weights), a hub model by its id and resolved revision (the snapshot's commit when the hub cache
    has it)."""
    if os.path.isdir(model):
        try:
            content = manifest_digest(model, full_hash)
        except FileNotFoundError:
            content = "empty"
        return f"dir:{Path(model).resolve()}#{content}"
    rev = revision or "main"
    try:
        from huggingface_hub import snapshot_download

        snap = snapshot_download(model, revision=revision, local_files_only=True)
        rev = Path(snap).name  # snapshots/<commit>
    except Exception as exc:  # not in the local hub cache: the revision as given
        logger.warning("MemCacheConnector: cannot resolve %s@%s to a commit (%s); the key namespace "
                       "uses the revision as given, pin --revision to share a pool safely",
                       model, rev, exc)
    return f"hub:{model}@{rev}"


def model_config_factors(mc: Any, full_hash: bool = False) -> dict[str, Any]:
    """The model settings that change KV bytes, from a vLLM ``ModelConfig``.

    Not ``ModelConfig.compute_hash()``: it also hashes settings that never change a block's bytes
    (``max_model_len``, ``max_logprobs``, sleep mode, generation config), which would keep
    instances that could share apart, and the model path unresolved.
    """
    hf = mc.hf_config
    cfg = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    for key in _CONFIG_NOISE:
        cfg.pop(key, None)
    text_cfg = mc.hf_text_config
    text = text_cfg.to_dict() if text_cfg is not hf and hasattr(text_cfg, "to_dict") else None
    if text is not None:
        for key in _CONFIG_NOISE:
            text.pop(key, None)
    quant_cfg = getattr(mc, "quantization_config", None)
    return {
        "checkpoint": checkpoint_identity(str(mc.model), getattr(mc, "revision", None), full_hash),
        "model_weights": str(getattr(mc, "model_weights", "") or ""),
        "code_revision": str(getattr(mc, "code_revision", None)),
        "hf_config": cfg,
        "hf_text_config": text,
        "dtype": str(mc.dtype),
        "quantization": str(getattr(mc, "quantization", None)),
        "quantization_config": quant_cfg if quant_cfg is None or isinstance(quant_cfg, dict)
        else str(quant_cfg),
        "disable_sliding_window": bool(getattr(mc, "disable_sliding_window", False)),
        "model_impl": str(getattr(mc, "model_impl", "auto")),
    }


def logical_kv_cache_dtype(cache_dtype: str, model_dtype: Any) -> str:
    """The KV-cache dtype as stored: ``auto`` is the model dtype, so ``--kv-cache-dtype auto``
    and an explicit ``bfloat16`` on a bfloat16 model share blocks."""
    if cache_dtype == "auto":
        return str(model_dtype).removeprefix("torch.")
    return cache_dtype


def speculative_factors(spec: Any) -> dict[str, Any] | None:
    """What speculative decoding adds to the KV cache (a draft model's layers, MTP heads): the
    method, the draft model and the number of speculative tokens."""
    if spec is None:
        return None
    return {"method": str(getattr(spec, "method", None)), "model": str(getattr(spec, "model", None)),
            "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None)}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Namespace:
    """Everything that decides the bytes of a block, except the block's own tokens."""

    label: str
    tenant: str
    factors_digest: str
    """Digest of ``factors`` (model identity and config, KV dtype, block size, layout, ...)."""
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    tp_shared: bool = False
    """MLA: every TP rank holds an identical copy of each block; one key serves them all."""

    @classmethod
    def build(cls, vllm_config: Any, block_size: int, cache_prefix: str, layout: str,
              weights_full_hash: bool = False) -> Namespace:
        """``layout``: the workers' KV-cache layout signature (``layout.layout_signature``);
        ``weights_full_hash``: identify weight files by the SHA-256 of their bytes."""
        mc = vllm_config.model_config
        cc = vllm_config.cache_config
        pc = vllm_config.parallel_config
        factors: dict[str, Any] = {
            "model": model_config_factors(mc, weights_full_hash),
            "kv_cache_dtype": logical_kv_cache_dtype(str(cc.cache_dtype), mc.dtype),
            "speculative": speculative_factors(getattr(vllm_config, "speculative_config", None)),
            "calculate_kv_scales": bool(getattr(cc, "calculate_kv_scales", False)),
            "block_size": int(block_size),
            "num_kv_heads": int(mc.get_total_num_kv_heads()),
            "head_size": int(mc.get_head_size()),
            "hash_algo": str(getattr(cc, "prefix_caching_hash_algo", "sha256")),
            "device": str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")),
            "layout": layout,
            "tp_size": int(pc.tensor_parallel_size),
            "pp_size": int(pc.pipeline_parallel_size),
            "pcp_size": int(getattr(pc, "prefill_context_parallel_size", 1) or 1),
            "dcp_size": int(getattr(pc, "decode_context_parallel_size", 1) or 1),
            "cache_prefix": cache_prefix,
        }
        return cls(label=_sanitize(str(mc.model).rstrip("/").split("/")[-1], 32),
                   tenant=_sanitize(cache_prefix, 32), factors_digest=_digest(factors),
                   tp_size=factors["tp_size"], pp_size=factors["pp_size"],
                   pcp_size=factors["pcp_size"], tp_shared=bool(getattr(mc, "use_mla", False)))

    @property
    def head(self) -> str:
        """The part of every key before the epoch (what ``reset_cache`` removes)."""
        tenant = f"{self.tenant}@" if self.tenant else ""
        return f"mc@{tenant}{self.label}@{self.factors_digest[:20]}@"

    @property
    def ranks(self) -> list[tuple[int, int, int]]:
        """Every (tp_rank, pp_rank, pcp_rank) that stores a share of each block (TP rank 0 only
        when the TP ranks share one copy)."""
        tp_ranks = 1 if self.tp_shared else self.tp_size
        return [(t, p, c) for c in range(self.pcp_size) for p in range(self.pp_size)
                for t in range(tp_ranks)]

    def saves(self, tp_rank: int) -> bool:
        """Whether this TP rank writes its blocks (all do, but only rank 0 of a shared copy)."""
        return not self.tp_shared or tp_rank == 0

    def epoch_head(self, epoch: str) -> str:
        return f"{self.head}e{epoch}@"

    def rank_prefix(self, epoch: str, tp_rank: int, pp_rank: int, pcp_rank: int = 0) -> str:
        """Everything of a key but the block name, for one rank."""
        pcp = f"pcp{pcp_rank}of{self.pcp_size}@" if self.pcp_size > 1 else ""
        tp = "all" if self.tp_shared else tp_rank
        return f"{self.epoch_head(epoch)}tp{tp}of{self.tp_size}@pp{pp_rank}of{self.pp_size}@{pcp}"

    def keys(self, epoch: str, names: Sequence[str], tp_rank: int, pp_rank: int,
             pcp_rank: int = 0) -> list[str]:
        """Keys of the blocks ``names`` (``block_names``) for one rank."""
        head = self.rank_prefix(epoch, tp_rank, pp_rank, pcp_rank)
        out = [head + n for n in names]
        for key in out:
            if len(key.encode()) > MAX_KEY_BYTES:
                raise ValueError(f"pool key too long ({len(key)} bytes): {key[:80]}...")
        return out

    def rank_keys(self, epoch: str, names: Sequence[str]) -> list[list[str]]:
        """Per block of ``names``, its key on every rank (``ranks``), in that order."""
        per_rank = [self.keys(epoch, names, *rank) for rank in self.ranks]
        return [list(k) for k in zip(*per_rank, strict=True)]


def block_hashes_hex(request_hashes: Sequence[bytes], start: int, end: int, ratio: int) -> list[str]:
    """Hex hashes of blocks ``[start, end)`` of a request.

    ``request_hashes`` are vLLM's hashes at ``hash_block_size`` granularity; a block of
    ``ratio * hash_block_size`` tokens is named by the last sub-hash it contains (the chain makes it
    identify the whole prefix).
    """
    return [bytes(request_hashes[(i + 1) * ratio - 1]).hex() for i in range(start, end)]


class AdapterChanged(OSError):
    """A LoRA adapter's files changed on disk since the engine loaded it."""


class AdapterDigests:
    """Content digests of LoRA adapters as the engine loaded them, not as their files are now.

    An adapter's digest (all its files' bytes, :func:`memcache_core.checkpoint.manifest_digest`)
    is taken when the scheduler first sees its ``lora_int_id`` (vLLM's workers load it for that
    very request) and again when a request reloads it (``load_inplace``). When its files change
    on disk in between, the engine serves the contents it loaded, or the new ones if it evicted
    the adapter and loaded it again: which, the scheduler cannot tell, so ``tag`` raises
    :class:`AdapterChanged` and the adapter's blocks are neither looked up nor saved until a
    request reloads it.
    """

    def __init__(self) -> None:
        self._loaded: dict[int, tuple[tuple, str]] = {}
        """lora_int_id -> (the files' names, sizes and mtimes when loaded, digest)."""

    @staticmethod
    def _stamp(lora_path: str) -> tuple:
        root = Path(lora_path)
        files = sorted(p for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file())
        if not files:
            raise FileNotFoundError(f"LoRA adapter {lora_path}: no files to identify it by")
        return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)

    def tag(self, lora_int_id: int, lora_path: str, reload: bool = False) -> str:
        """The digest of adapter ``lora_int_id`` as loaded; ``reload``: the engine loads it again
        now (``load_inplace``)."""
        stamp = self._stamp(lora_path)
        hit = self._loaded.get(lora_int_id)
        if hit is not None and not reload:
            if hit[0] != stamp:
                raise AdapterChanged(f"LoRA adapter {lora_int_id} ({lora_path}) changed on disk since "
                                     f"it was loaded; reload it with load_inplace=True")
            return hit[1]
        digest = manifest_digest(lora_path, full=True)[:16]
        self._loaded[lora_int_id] = (stamp, digest)
        return digest


def block_names(hashes_hex: Sequence[str], adapter_tag: str | None) -> list[str]:
    """Block names in keys: the block hash, plus the adapter's content digest for LoRA requests."""
    if adapter_tag is None:
        return list(hashes_hex)
    return [f"{h}.l{adapter_tag}" for h in hashes_hex]
