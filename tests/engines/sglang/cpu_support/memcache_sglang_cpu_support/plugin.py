"""``sglang.srt.plugins`` entry point: make SGLang's HiCache host pool work on a CPU-only host.

Stock SGLang 0.5.23 binds the host<->device KV transfer functions of the MHA host pool only for
CUDA/HIP/XPU, and pins host memory through CUDA. This plugin, loaded in every SGLang process of
the test environment, supplies torch-indexing versions of the ``direct`` IO functions and turns
pinning off. It changes nothing about the L3 storage path, which is what the tests exercise.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def _page_coords(indices: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    indices = indices.to(torch.int64)
    return torch.div(indices, page_size, rounding_mode="floor"), indices % page_size


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Token-major to token-major copy, one tensor per layer (layer_first host layout)."""
    src_idx = src_indices.to(torch.int64)
    dst_idx = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_idx] = src[src_idx].to(dst.dtype)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host ``(page, layer, page_size, ...)`` to device ``(token, ...)`` for one layer (load)."""
    page, offset = _page_coords(src_indices, page_size)
    dst_idx = dst_indices.to(torch.int64)
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_idx] = src[page, layer_id, offset].to(dst.dtype)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device per-layer ``(token, ...)`` (all K layers, then all V layers) to host page-first (backup)."""
    page, offset = _page_coords(dst_indices, page_size)
    src_idx = src_indices.to(torch.int64)
    num_layers = len(src_ptrs) // len(dst_ptrs)
    for part, dst in enumerate(dst_ptrs):
        for layer in range(num_layers):
            src = src_ptrs[part * num_layers + layer]
            dst[page, layer, offset] = src[src_idx].to(dst.dtype)


def _alloc_plain(
    dims: tuple,
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: object,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """Host pool memory without cudaHostRegister (there is no CUDA driver)."""
    if allocator is not None and hasattr(allocator, "allocate"):
        return allocator.allocate(dims, dtype=dtype, device=device)
    return torch.empty(dims, dtype=dtype, device=device)


def register() -> None:
    if torch.cuda.is_available():
        logger.info("CUDA is available; CPU HiCache scaffolding not applied")
        return
    from sglang.srt.mem_cache.pool_host import base, common, mha

    common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_plain
    for name, func in (
        ("transfer_kv_direct", transfer_kv_direct),
        ("transfer_kv_per_layer_direct_pf_lf", transfer_kv_per_layer_direct_pf_lf),
        ("transfer_kv_all_layer_direct_lf_pf", transfer_kv_all_layer_direct_lf_pf),
    ):
        if not hasattr(mha, name):
            setattr(mha, name, func)

    init = base.HostKVCache.__init__
    if not getattr(init, "_memcache_cpu_unpinned", False):

        @functools.wraps(init)
        def unpinned_init(self, *args, **kwargs) -> None:  # noqa: ANN001
            kwargs["pin_memory"] = False
            init(self, *args, **kwargs)

        unpinned_init._memcache_cpu_unpinned = True  # type: ignore[attr-defined]
        base.HostKVCache.__init__ = unpinned_init  # type: ignore[method-assign]
    logger.info("CPU HiCache scaffolding applied (direct IO functions, unpinned host pool)")
