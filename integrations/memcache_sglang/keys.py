"""Object keys of the ``npu_memcache`` backend.

SGLang hands the backend bare 64-hex SHA-256 page hashes (chained over the token ids, seeded by
``extra_key``/``cache_salt``). The hash says *which tokens*; it does not say which model, dtype,
host layout, page size or tensor-parallel shard produced the bytes. The built-in backend's keys
(``{hash}_{tp_rank}_k``) omit all of these, so two servers of different models or layouts that
share one pool read each other's bytes. Our keys cannot collide:

    [{extra_backend_tag}:]sgl1.{namespace}.{page_hash}.{shard}[.{pool}]

* ``namespace`` - 16 hex chars of SHA-256 over the *namespace identity* (:class:`LayoutIdentity`):
  the model identity (checkpoint, effective config, quantization, start-up LoRA adapters, weight
  version; :mod:`memcache_sglang.identity`; never the served model name, a label), the logical KV
  dtype and the host pool's storage dtype, its storage-format tag, host layout, page size,
  MHA/MLA, the head sharding (``tp{tp_size}``, or ``hs{tp_lcm_size}`` for ``page_head`` pools
  whose heads are split to a common multiple so servers of different TP sizes share objects), PP
  and attention-CP sizes, and the byte size of every piece of a page.
* ``shard`` - which part of the page this process holds: ``r{head_group}`` for MHA plus
  ``p{pp_rank}c{attn_cp_rank}``; MLA pages are replicated across TP ranks and omit ``r``.
* ``pool`` - the hybrid side pool (``mamba``, ``indexer``, ``draft``, ...) for the v2 calls; the
  plain KV pool has none.

One object holds all the pieces of one page shard (MHA: K then V; MLA: k, v, index_k, scale as the
host pool lists them), written and read with the layered put/get calls, so a page is present
whole or not at all. Keys stay well under MemCache's 256-byte limit (~100 bytes plus the tag).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

KEY_VERSION = "sgl1"
MAX_KEY_BYTES = 255


@dataclass(frozen=True)
class LayoutIdentity:
    """Everything that decides a page's bytes and their layout; hashed into the namespace."""

    model: str  # ModelIdentity.digest()
    kv_dtype: str  # logical: "fp8_e4m3" and "fp8_e5m2" both store as uint8
    dtype: str  # the host pool's storage dtype
    storage_format: str  # the host pool's storage-format tag ("" when it has none)
    layout: str
    page_size: int
    attention: str  # "mha" | "mla"
    head_sharding: str  # "tp{n}" | "hs{n}" | "replicated"
    pp_size: int
    attn_cp_size: int
    piece_sizes: tuple[int, ...]  # bytes of each piece of one page shard, in IO order

    def namespace(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class KeyScheme:
    """Builds object keys for one process (one TP/PP/CP rank) of one server."""

    def __init__(self, identity: LayoutIdentity, shard_ids: list[str], tag: str | None = None) -> None:
        if not shard_ids:
            raise ValueError("a key scheme needs at least one shard id")
        self.identity = identity
        self.namespace = identity.namespace()
        self.prefix = f"{tag}:" if tag else ""
        self.prefix += f"{KEY_VERSION}.{self.namespace}."
        self.shard_ids = list(shard_ids)
        longest = len(self.page_key("0" * 64, self.shard_ids[-1], "draft_indexer").encode())
        if longest > MAX_KEY_BYTES:
            raise ValueError(f"extra_backend_tag too long: keys would be {longest} bytes (max {MAX_KEY_BYTES})")

    @property
    def objects_per_page(self) -> int:
        return len(self.shard_ids)

    def page_key(self, page_hash: str, shard_id: str, pool: str | None = None) -> str:
        key = f"{self.prefix}{page_hash}.{shard_id}"
        return f"{key}.{pool}" if pool else key

    def kv_keys(self, page_hashes: list[str]) -> list[str]:
        """Keys of the plain KV pool: ``objects_per_page`` consecutive keys per page."""
        return [self.page_key(h, s) for h in page_hashes for s in self.shard_ids]

    def pool_keys(self, page_hashes: list[str], pool: str, shard_id: str) -> list[str]:
        """Keys of a hybrid side pool: one object per page."""
        return [self.page_key(h, shard_id, pool) for h in page_hashes]

    def owns(self, key: str) -> bool:
        """True for every key of this namespace (any rank, any pool)."""
        return key.startswith(self.prefix)


def shard_suffix(pp_rank: int, attn_cp_rank: int) -> str:
    return f"p{pp_rank}c{attn_cp_rank}"
