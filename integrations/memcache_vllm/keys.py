"""Pool keys for vLLM KV blocks.

A key names one block of one rank, all layers of that rank:

    mc@<prefix>@<model>@<dtype>@b<block>@<layout digest>@tp<r>of<n>@pp<r>of<n>@<block hash hex>

``<block hash hex>`` is vLLM's chained block hash (it already identifies the whole prefix up to and
including the block). Everything before it is the namespace: two instances share blocks only when
model, KV dtype, block size, KV shape (layers, heads, head size), device type, block hash
algorithm and rank layout all agree, so a
different model or setting never reads another's bytes. Keys stay below the store's 256-byte limit.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

MAX_KEY_BYTES = 255
_UNSAFE = re.compile(r"[^A-Za-z0-9._\-]")


@dataclass(frozen=True)
class KeySpace:
    """The key namespace of one vLLM deployment (model, KV layout, parallel layout)."""

    model: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int = 1
    pp_size: int = 1
    prefix: str = ""
    hash_algo: str = "sha256"
    device: str = "cpu"
    """Device type of the KV caches: CPU and GPU attention backends lay a block out differently."""

    @classmethod
    def from_vllm_config(cls, vllm_config: object, block_size: int, prefix: str = "") -> KeySpace:
        """Build the namespace from a ``VllmConfig`` (same answer in the scheduler and workers)."""
        mc = vllm_config.model_config  # type: ignore[attr-defined]
        cc = vllm_config.cache_config  # type: ignore[attr-defined]
        pc = vllm_config.parallel_config  # type: ignore[attr-defined]
        dtype = str(cc.cache_dtype)
        if dtype == "auto":
            dtype = str(mc.dtype).removeprefix("torch.")
        return cls(
            model=str(mc.model).rstrip("/").split("/")[-1],
            kv_dtype=dtype,
            block_size=int(block_size),
            num_layers=int(getattr(mc.hf_text_config, "num_hidden_layers", 0) or 0),
            num_kv_heads=int(mc.get_total_num_kv_heads()),
            head_size=int(mc.get_head_size()),
            tp_size=int(pc.tensor_parallel_size),
            pp_size=int(pc.pipeline_parallel_size),
            prefix=prefix,
            hash_algo=str(getattr(cc, "prefix_caching_hash_algo", "sha256")),
            device=str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")),
        )

    @property
    def ranks(self) -> list[tuple[int, int]]:
        """Every (tp_rank, pp_rank) that stores a share of each block."""
        return [(t, p) for p in range(self.pp_size) for t in range(self.tp_size)]

    def _digest(self) -> str:
        shape = (f"{self.num_layers}/{self.num_kv_heads}/{self.head_size}/{self.hash_algo}/{self.device}/"
                 f"{self.model}/{self.kv_dtype}/{self.block_size}/{self.tp_size}/{self.pp_size}")
        return hashlib.sha256(shape.encode()).hexdigest()[:12]

    def rank_prefix(self, tp_rank: int, pp_rank: int) -> str:
        """Everything of a key but the block hash, for one rank."""
        head = "mc@"
        if self.prefix:
            head += _UNSAFE.sub("_", self.prefix)[:32] + "@"
        model = _UNSAFE.sub("_", self.model)[:64]
        return (f"{head}{model}@{self.kv_dtype}@b{self.block_size}@{self._digest()}"
                f"@tp{tp_rank}of{self.tp_size}@pp{pp_rank}of{self.pp_size}@")

    def keys(self, block_hashes: Sequence[str], tp_rank: int, pp_rank: int) -> list[str]:
        """Keys of ``block_hashes`` (hex strings) for one rank."""
        head = self.rank_prefix(tp_rank, pp_rank)
        out = [head + h for h in block_hashes]
        if out and len(out[0].encode()) > MAX_KEY_BYTES:
            raise ValueError(f"pool key too long ({len(out[0])} bytes): {out[0][:80]}...")
        return out


def block_hashes_hex(request_hashes: Sequence[bytes], start: int, end: int, ratio: int) -> list[str]:
    """Hex hashes of blocks ``[start, end)`` of a request.

    ``request_hashes`` are vLLM's hashes at ``hash_block_size`` granularity; a block of
    ``ratio * hash_block_size`` tokens is named by the last sub-hash it contains (the chain makes it
    identify the whole prefix).
    """
    return [bytes(request_hashes[(i + 1) * ratio - 1]).hex() for i in range(start, end)]
