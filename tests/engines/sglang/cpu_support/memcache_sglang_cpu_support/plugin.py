"""``sglang.srt.plugins`` entry point: make SGLang's HiCache host pool work on a CPU-only host.

Stock SGLang 0.5.23 binds the host<->device KV transfer functions of the MHA host pool only for
CUDA/HIP/XPU, and pins host memory through CUDA. This plugin, loaded in every SGLang process of
the test environment, replaces the MHA host pool's two host<->device copy methods with
torch-indexing versions that serve every io backend and host layout (``layer_first``,
``page_first``, ``page_first_direct``, ``page_head``), and turns pinning off. It changes nothing about the L3 storage path, which is what the tests exercise.

It also lowers the host memory SGLang keeps in reserve before it sizes a host pool
(``HICACHE_HOST_MEMORY_RESERVE_BYTES``, 10 GiB in stock SGLang, sized for GPU servers) to
``TEST_HOST_MEMORY_RESERVE_BYTES``. The test servers ask for about 50 MB of host pool each, and two
test runs on one 24 GiB host hold eight of them plus their engines: with the stock reserve SGLang
refuses to start ("Not enough host memory available ... -0.07 GB free") although gigabytes are free.

And it gives the "device" KV pool a fixed byte budget, ``TEST_KV_POOL_BUDGET_BYTES``, instead of
profiling it. On a CPU, SGLang profiles the host's available memory before and after loading the
weights and refuses to start when it fell by more than ``1 - --mem-fraction-static`` in between.
On a host shared with other test runs, their engines starting at the same moment made it fall that
far ("Loaded weights leave no GPU memory for the KV cache ... minimum viable 0.3007"). The budget is
far above what ``--max-total-tokens`` of the test servers needs, so SGLang caps the pool at exactly
that many tokens, as it did with a profiled budget.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

TEST_HOST_MEMORY_RESERVE_BYTES = 1 << 30
TEST_KV_POOL_BUDGET_BYTES = 1 << 30


def _token_index(layout: str, page_size: int, indices: torch.Tensor, layer: int) -> tuple:
    """Index into a host K or V buffer selecting ``layer`` of every token in ``indices``.

    ``buf[index]`` has shape ``(len(indices), heads, head_dim)`` for every
    MHA host layout (advanced indices separated by a slice move to the front).
    """
    idx = indices.to(torch.int64)
    page, off = torch.div(idx, page_size, rounding_mode="floor"), idx % page_size
    if layout == "layer_first":  # (L, size, H, D)
        return (layer, idx)
    if layout == "page_first":  # (size, L, H, D)
        return (idx, layer)
    if layout == "page_first_direct":  # (pages, L, page_size, H, D)
        return (page, layer, off)
    if layout == "page_head":  # (pages, H, page_size, L, D)
        return (page, slice(None), off, layer)
    raise ValueError(f"CPU scaffolding does not support host layout {layout!r}")


def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend,  # noqa: ANN001
                             *, is_draft: bool = False) -> None:
    """Host -> device for one layer, any io_backend, any MHA host layout (torch indexing)."""
    if not is_draft and not 0 <= layer_id < self.target_layer_num:
        return
    dst_idx = device_indices.to(torch.int64)
    for host_buf, dev in ((self.k_buffer, self.device_k_buffers[layer_id]),
                          (self.v_buffer, self.device_v_buffers[layer_id])):
        index = _token_index(self.layout, self.page_size, host_indices, layer_id)
        dev[dst_idx] = host_buf[index].to(dev.dtype)


def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:  # noqa: ANN001
    """Device -> host for every layer, any io_backend, any MHA host layout (torch indexing)."""
    src_idx = device_indices.to(torch.int64)
    for host_buf, layers in ((self.k_buffer, self.device_k_buffers), (self.v_buffer, self.device_v_buffers)):
        for layer, dev in enumerate(layers):
            index = _token_index(self.layout, self.page_size, host_indices, layer)
            host_buf[index] = dev[src_idx].to(host_buf.dtype)


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


def _fixed_kv_budget(self, pre_model_load_memory: int) -> int:  # noqa: ANN001
    """The "device" KV pool's byte budget, independent of what other processes hold meanwhile."""
    return TEST_KV_POOL_BUDGET_BYTES


def register() -> None:
    if torch.cuda.is_available():
        logger.info("CUDA is available; CPU HiCache scaffolding not applied")
        return
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.pool_host import base, common, mha

    common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_plain
    # Read by base.host_memory_budget_bytes at every call, so setting the module global is enough.
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = min(base.HICACHE_HOST_MEMORY_RESERVE_BYTES,
                                                 TEST_HOST_MEMORY_RESERVE_BYTES)
    KVCacheConfigurator._profile_available_bytes = _fixed_kv_budget  # type: ignore[method-assign]
    mha.MHATokenToKVPoolHost.load_to_device_per_layer = load_to_device_per_layer
    mha.MHATokenToKVPoolHost.backup_from_device_all_layer = backup_from_device_all_layer

    init = base.HostKVCache.__init__
    if not getattr(init, "_memcache_cpu_unpinned", False):

        @functools.wraps(init)
        def unpinned_init(self, *args, **kwargs) -> None:  # noqa: ANN001
            kwargs["pin_memory"] = False
            init(self, *args, **kwargs)

        unpinned_init._memcache_cpu_unpinned = True  # type: ignore[attr-defined]
        base.HostKVCache.__init__ = unpinned_init  # type: ignore[method-assign]
    logger.info("CPU HiCache scaffolding applied (direct IO functions, unpinned host pool, %d MiB host "
                "memory reserve, %d MiB KV pool budget)", base.HICACHE_HOST_MEMORY_RESERVE_BYTES >> 20,
                TEST_KV_POOL_BUDGET_BYTES >> 20)
