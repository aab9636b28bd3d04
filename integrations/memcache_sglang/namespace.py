"""The key namespace of one backend instance: its layout, its shards, the weights it serves.

The layout (:class:`~memcache_sglang.keys.LayoutIdentity`) and this rank's shard ids are fixed when
SGLang registers the host pool (:func:`build_layout`), as are the start-up parts of the model
identity (:func:`model_config_digests`). The weights are not: an update swaps them while the server
runs (:mod:`memcache_sglang.weight_updates`), and :class:`Namespace` then builds the key scheme of
the new weights on the first call that sees them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from memcache_sglang.identity import (
    ModelIdentity,
    checkpoint_files_digest,
    effective_config_digest,
    logical_kv_dtype,
    lora_adapters_digest,
    resolve_checkpoint,
)
from memcache_sglang.keys import KeyScheme, LayoutIdentity, shard_suffix
from memcache_sglang.weight_updates import WeightState, current_weight_state

logger = logging.getLogger(__name__)


def build_layout(sc: Any, pool: Any, page_piece_sizes: list[int]) -> tuple[LayoutIdentity, list[str]]:
    """The layout identity (model left empty) and this rank's shard ids, from SGLang's storage config
    ``sc``, the host pool and the sizes of the pieces of one page (all shards, in IO order)."""
    from sglang.srt.runtime_context import get_model

    ppcp = shard_suffix(sc.pp_rank, sc.attn_cp_rank)
    if sc.is_mla_model:
        sharding, shard_ids = "replicated", [ppcp]
    elif pool.layout == "page_head" and sc.tp_lcm_size and sc.tp_lcm_size % sc.tp_size == 0:
        f = sc.tp_lcm_size // sc.tp_size
        sharding = f"hs{sc.tp_lcm_size}"
        shard_ids = [f"r{sc.tp_rank * f + i}{ppcp}" for i in range(f)]
    else:
        sharding, shard_ids = f"tp{sc.tp_size}", [f"r{sc.tp_rank}{ppcp}"]
    per_obj = len(page_piece_sizes) // len(shard_ids)
    storage_dtype = str(getattr(pool, "dtype", "")).removeprefix("torch.")
    identity = LayoutIdentity(
        model="",  # filled by Namespace.scheme() from the weights served at the time
        kv_dtype=logical_kv_dtype(get_model().kv_cache_dtype, storage_dtype),
        dtype=storage_dtype,
        storage_format=str(getattr(pool, "storage_format_tag", None) or ""),
        layout=pool.layout,
        page_size=int(pool.page_size),
        attention="mla" if sc.is_mla_model else "mha",
        head_sharding=sharding,
        pp_size=sc.pp_size,
        attn_cp_size=sc.attn_cp_size,
        piece_sizes=tuple(int(s) for s in page_piece_sizes[:per_obj]),
    )
    return identity, shard_ids


def model_config_digests() -> dict[str, str]:
    """The parts of the model identity fixed at start-up: effective config and LoRA adapters."""
    from sglang.srt.runtime_context import get_lora, get_model

    model = get_model()
    return {"config": effective_config_digest(model), "lora": lora_adapters_digest(get_lora().lora_paths),
            "revision": str(model.revision or "")}


class Namespace:
    """The key scheme for the weights served now; rebuilt when a weight update changed them.

    Safe from every SGLang thread: the current (weights, scheme) pair is swapped as a whole, and a
    new one is built once, under a lock.
    """

    def __init__(self, layout: LayoutIdentity, shard_ids: list[str], model_digests: dict[str, str],
                 tag: str | None, weights_full_hash: bool = False) -> None:
        self.layout = layout
        self.weights_full_hash = weights_full_hash
        self.shard_ids = shard_ids
        self.model_digests = model_digests
        self.tag = tag
        self._current: tuple[WeightState, KeyScheme] | None = None
        self._lock = threading.Lock()

    def scheme(self) -> KeyScheme:
        state = current_weight_state()
        current = self._current
        if current is not None and current[0] == state:
            return current[1]
        with self._lock:
            current = self._current
            if current is not None and current[0] == state:
                return current[1]
            model = ModelIdentity(
                checkpoint=resolve_checkpoint(state.model_path, self.model_digests["revision"] or None),
                files=checkpoint_files_digest(state.model_path, self.weights_full_hash),
                config=self.model_digests["config"],
                lora=self.model_digests["lora"],
                weights=state.label,
            )
            keys = KeyScheme(replace(self.layout, model=model.digest()), self.shard_ids, self.tag)
            self._current = (state, keys)
        page_bytes = sum(keys.identity.piece_sizes) * keys.objects_per_page
        logger.info("npu_memcache keys: namespace %s (%s; %s), %d object(s) per page, %d bytes per page",
                    keys.namespace, model, keys.identity, keys.objects_per_page, page_bytes)
        return keys
