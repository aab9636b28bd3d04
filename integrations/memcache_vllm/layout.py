"""Where the bytes of one vLLM KV block lie, and how they reach a pool object.

A pool object is one block of all layers of one rank: for every layer, the block's slice of that
layer's KV tensor, as one or more contiguous pieces. The block's dimension is found by its size
(``num_blocks``) and strides: dimensions with a smaller stride must fill the block's stride exactly
(they are one contiguous piece); each index of a dimension with a larger stride (e.g. K and V as
two halves of the tensor) is a separate piece. So the CPU layout
``[num_blocks, kv_heads, block_size, 2*head_size]`` is one piece per layer per block, and a
``[2, num_blocks, ...]`` layout is two.

Host tensors are moved in place (the store reads and writes the pieces through registered
buffers). Tensors on a CUDA device go through a pinned host staging buffer: blocks are gathered on
the device and copied out in one transfer per layer, and scattered back the same way.

:func:`check_kv_cache_config` refuses, in the scheduler and in every worker, the KV caches whose
blocks are not all the request's own (sliding-window and chunked-local groups).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("vllm." + __name__)


@dataclass
class LayerLayout:
    name: str
    tensor: torch.Tensor
    block_dim: int
    block_stride: int
    """Bytes between consecutive blocks."""
    piece_bytes: int
    outer_offsets: list[int]
    """Byte offset of each piece of a block, relative to the block's start."""

    @property
    def block_bytes(self) -> int:
        return self.piece_bytes * len(self.outer_offsets)


def _layer_layout(name: str, t: torch.Tensor, num_blocks: int) -> LayerLayout:
    shape, strides, elem = list(t.shape), list(t.stride()), t.element_size()
    candidates = [d for d, n in enumerate(shape) if n == num_blocks]
    if not candidates:
        raise ValueError(f"KV cache {name}: no dimension of size num_blocks={num_blocks} in {shape}")
    b = candidates[0]
    inner = sorted((strides[d], shape[d]) for d in range(len(shape))
                   if d != b and strides[d] < strides[b] and shape[d] > 1)
    expected = 1
    for stride, size in inner:
        if stride != expected:
            raise ValueError(f"KV cache {name}: a block is not contiguous (shape {shape}, strides {strides})")
        expected *= size
    if expected != strides[b]:
        raise ValueError(f"KV cache {name}: blocks are padded or overlap (shape {shape}, strides {strides})")
    outer = [d for d in range(len(shape)) if d != b and strides[d] > strides[b] and shape[d] > 1]
    offsets = [sum(i * strides[d] * elem for i, d in zip(idx, outer, strict=False))
               for idx in itertools.product(*(range(shape[d]) for d in outer))]
    return LayerLayout(name, t, b, strides[b] * elem, strides[b] * elem, offsets)


class BlockLayout:
    """The pieces of every block across all layers registered by vLLM, in a fixed order."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors registered")
        self.layers = [_layer_layout(name, t, num_blocks) for name, t in kv_caches.items()]
        devices = {t.device for t in kv_caches.values()}
        if len(devices) != 1:
            raise ValueError(f"KV caches span several devices: {devices}")
        self.device = devices.pop()
        self.num_blocks = num_blocks
        self.block_bytes = sum(layer.block_bytes for layer in self.layers)
        self.pieces_per_block = sum(len(layer.outer_offsets) for layer in self.layers)

    @property
    def on_host(self) -> bool:
        return self.device.type == "cpu"

    def regions(self) -> list[tuple[int, int]]:
        """Distinct memory regions holding the KV caches (to register with the store)."""
        seen: dict[int, int] = {}
        for layer in self.layers:
            storage = layer.tensor.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return sorted(seen.items())

    def pieces(self, block_id: int) -> tuple[list[int], list[int]]:
        """Pointers and sizes of one block's pieces, in place (host tensors only)."""
        ptrs: list[int] = []
        sizes: list[int] = []
        for layer in self.layers:
            base = layer.tensor.data_ptr() + block_id * layer.block_stride
            for off in layer.outer_offsets:
                ptrs.append(base + off)
                sizes.append(layer.piece_bytes)
        return ptrs, sizes


class DeviceStager:
    """A pinned host buffer of ``capacity`` blocks for KV caches on a CUDA device.

    Slot ``s`` holds one block of all layers in the same piece order as ``BlockLayout.pieces``, so
    an object's bytes are the same whether it was staged or read in place.
    """

    def __init__(self, layout: BlockLayout, capacity: int) -> None:
        self.layout = layout
        self.capacity = max(1, capacity)
        self.buffer = torch.empty((self.capacity, layout.block_bytes), dtype=torch.uint8,
                                  pin_memory=torch.cuda.is_available())
        self._layer_offsets = list(itertools.accumulate(
            [0] + [layer.block_bytes for layer in layout.layers]))[:-1]

    def region(self) -> tuple[int, int]:
        return self.buffer.data_ptr(), self.buffer.numel()

    def pieces(self, slot: int) -> tuple[list[int], list[int]]:
        base = self.buffer.data_ptr() + slot * self.layout.block_bytes
        ptrs: list[int] = []
        sizes: list[int] = []
        for layer, loff in zip(self.layout.layers, self._layer_offsets, strict=False):
            for i in range(len(layer.outer_offsets)):
                ptrs.append(base + loff + i * layer.piece_bytes)
                sizes.append(layer.piece_bytes)
        return ptrs, sizes

    def gather(self, block_ids: list[int]) -> None:
        """Copy device blocks into slots ``0..len(block_ids)-1`` (waits for the copies)."""
        n = len(block_ids)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.layout.device)
        for layer, loff in zip(self.layout.layers, self._layer_offsets, strict=False):
            sel = layer.tensor.index_select(layer.block_dim, idx).movedim(layer.block_dim, 0)
            data = sel.contiguous().view(torch.uint8).reshape(n, -1)
            self.buffer[:n, loff:loff + layer.block_bytes].copy_(data)
        _sync(self.layout.device)

    def scatter(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy slots into device blocks (waits for the copies)."""
        if not block_ids:
            return
        dev = self.layout.device
        idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
        rows = torch.tensor(slots, dtype=torch.long)
        for layer, loff in zip(self.layout.layers, self._layer_offsets, strict=False):
            t = layer.tensor
            rest = [s for d, s in enumerate(t.shape) if d != layer.block_dim]
            host = self.buffer.index_select(0, rows)[:, loff:loff + layer.block_bytes].contiguous()
            data = host.to(dev).view(t.dtype).reshape([len(block_ids)] + rest)
            t.index_copy_(layer.block_dim, idx, data.movedim(0, layer.block_dim))
        _sync(dev)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def staging_capacity(layout: BlockLayout, budget_bytes: int) -> int:
    return max(1, budget_bytes // max(1, layout.block_bytes))


def describe(kv_caches: dict[str, Any], num_blocks: int) -> BlockLayout:
    layout = BlockLayout(kv_caches, num_blocks)
    logger.info("MemCacheConnector: %d KV tensors on %s, %d pieces and %d bytes per block",
                len(layout.layers), layout.device, layout.pieces_per_block, layout.block_bytes)
    return layout


def tensor_signature(t: torch.Tensor, num_blocks: int) -> str:
    """A tensor's logical shape (the block dimension as ``B``), dtype and physical dimension order.

    Backends present the KV cache in their logical shape and permute memory by a stride order
    (NHD vs HND): two tensors of equal shape whose dimensions lie in memory in a different order
    hold a block's bytes in a different order, and get different signatures.
    """
    shape = ["B" if n == num_blocks else str(n) for n in t.shape]
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return f"{str(t.dtype).removeprefix('torch.')}[{','.join(shape)}]order{''.join(map(str, order))}"


def layout_signature(kv_caches: dict[str, torch.Tensor], num_blocks: int,
                     backends: list[str], resolved_layout: str | None) -> str:
    """What decides the byte order of a block: attention backend(s), vLLM's resolved KV-cache
    layout, and every distinct per-layer tensor signature. Part of the key namespace."""
    tensors = sorted({tensor_signature(t, num_blocks) for t in kv_caches.values()})
    return f"{'+'.join(sorted(set(backends))) or '?'}|{resolved_layout or '?'}|{';'.join(tensors)}"


def current_layout_signature(vllm_config: Any, kv_caches: dict[str, torch.Tensor],
                             num_blocks: int) -> str:
    """``layout_signature`` of this worker's registered KV caches (vLLM worker process)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backends = [b.get_name() for b in get_current_attn_backends(vllm_config, list(kv_caches))]
    resolved = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    return layout_signature(kv_caches, num_blocks, backends, resolved)


_SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


def check_kv_cache_config(kv_cache_config: Any) -> None:
    """Refuse, at start-up, models whose KV cache the connector cannot serve correctly.

    One KV-cache group of full attention only. Sliding-window and chunked-local attention groups
    replace blocks outside the window with vLLM's shared null block (block 0): loading into it or
    saving it under a real block hash corrupts the engine and the pool. A model that mixes full and
    sliding layers runs when vLLM's hybrid allocator is off (the connector turns it off): every
    layer then keeps all its blocks (``FullAttentionSpec`` with ``sliding_window``).
    """
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    if len(groups) != 1:
        raise ValueError(f"MemCacheConnector supports one KV-cache group, got {len(groups)} "
                         "(hybrid models are not supported)")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind not in _SUPPORTED_SPECS:
        raise ValueError(
            f"MemCacheConnector cannot serve this model: its KV cache is {kind} (sliding-window or "
            "chunked-local attention on every layer keeps only the blocks inside the window and "
            "pads the rest with vLLM's null block, which a pool must never load into or save). "
            "Supported: full attention (also MLA, and models mixing full and sliding layers with "
            "the hybrid KV-cache manager off). Serve this model without the connector, or with "
            "--disable-sliding-window.")
