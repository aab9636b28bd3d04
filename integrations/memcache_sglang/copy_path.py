"""The legacy copy calls of SGLang's generic storage path (``--hicache-storage-backend dynamic``
without ``interface_v1``): whole flat pages, one object per page and rank.

A page is read into a tensor (returned) or into a registered pointer (``True``), and written from
a tensor or a registered pointer. Each page is tried on its own; a failure is logged and reported
for that page (a miss, or a failed write), never raised into SGLang's IO threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

ObjectKeyFn = Callable[[str], str]


def _listed(values: Any, n: int) -> list[Any]:
    return list(values) if values is not None else [None] * n


def batch_get(store: Any, object_key: ObjectKeyFn, keys: list[str], target_locations: Any,
              target_sizes: Any) -> list[Any]:
    """Per page: the target tensor, ``True`` for a pointer read, or None for a miss."""
    out: list[Any] = [None] * len(keys)
    locations, sizes = _listed(target_locations, len(keys)), _listed(target_sizes, len(keys))
    for i, (key, loc, size) in enumerate(zip(keys, locations, sizes, strict=True)):
        try:
            if isinstance(loc, torch.Tensor):
                data = store.get(object_key(key))
                dst = loc.reshape(-1).view(torch.uint8)
                if data is None or len(data) != dst.numel():
                    continue
                dst.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                out[i] = loc
            elif loc is not None and size is not None:
                rc = store.batch_get_into([object_key(key)], [int(loc)], [int(size)])[0]
                out[i] = True if int(rc) == 0 else None
        except Exception:
            logger.exception("npu_memcache legacy get of %s failed", key)
    return out


def batch_set(store: Any, object_key: ObjectKeyFn, keys: list[str], values: Any, target_locations: Any,
              target_sizes: Any) -> bool:
    """True when every page was written."""
    n = len(keys)
    values, locations, sizes = _listed(values, n), _listed(target_locations, n), _listed(target_sizes, n)
    ok = True
    for key, value, loc, size in zip(keys, values, locations, sizes, strict=True):
        try:
            if isinstance(value, torch.Tensor):
                src = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                rc = store.put(object_key(key), memoryview(src))
            elif loc is not None and size is not None:
                rc = store.batch_put_from([object_key(key)], [int(loc)], [int(size)])[0]
            else:
                rc = -1
        except Exception:
            logger.exception("npu_memcache legacy set of %s failed", key)
            rc = -1
        ok = ok and int(rc) == 0
    return ok
