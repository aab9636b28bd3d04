"""What ``DistributedObjectStore`` (``local/store.py``) answers with: memcache_hybrid's copy directions,
``KeyInfo``, the conversion of exceptions into return codes and the checks of its integer arguments."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .. import errors
from ..config import ReplicateConfig
from ..errors import InvalidParameter, MemCacheError

logger = logging.getLogger(__name__)

# copy directions (accepted for compatibility; the path is chosen from the buffer and the segment)
L2G, G2L, G2H, H2G, AUTO = 0, 1, 2, 3, 4
DIRECTIONS: dict[int, bool | None] = {L2G: True, H2G: True, G2L: False, G2H: False, AUTO: None}


class KeyInfo:
    """What ``get_key_info`` returns, with memcache_hybrid's accessor methods. ``gva_list()`` holds one
    GVA per replica in a segment (``local/gva.py``), in the order of ``loc_list()``; a copy held on a
    disk tier only has a location and medium but no GVA."""

    def __init__(self, size: int, locations: list[int], media: list[str], gvas: list[int] | None = None) -> None:
        self._size, self._locs, self._media, self._gvas = size, locations, media, gvas or []

    def size(self) -> int:
        return self._size

    def loc_list(self) -> list[int]:
        return list(self._locs)

    def type_list(self) -> list[str]:
        return list(self._media)

    def gva_list(self) -> list[int]:
        return list(self._gvas)

    def __repr__(self) -> str:
        return f"KeyInfo(size={self._size}, locations={self._locs}, gvas={[hex(g) for g in self._gvas]})"


def code_of(fn: Callable[[], int]) -> int:
    try:
        return fn()
    except MemCacheError as e:
        logger.debug("call failed: %s", e)
        return e.code
    except (TypeError, ValueError) as e:
        logger.debug("call refused: %s", e)
        return errors.INVALID_PARAM


def codes_of(n: int, fn: Callable[[], list[int]]) -> list[int]:
    try:
        return fn()
    except MemCacheError as e:
        logger.debug("batch call failed: %s", e)
        return [e.code] * n
    except (TypeError, ValueError) as e:
        logger.debug("batch call refused: %s", e)
        return [errors.INVALID_PARAM] * n


def replication(rc: Any) -> tuple[int, list[int]]:
    """(replicaNum, preferredLocalServiceIDs) of a put's replicateConfig: ours, memcache_hybrid's, or
    any object with those attributes; validated (-3000 naming the field)."""
    if rc is None:
        return 1, []
    cfg = ReplicateConfig(getattr(rc, "replicaNum", 1), list(getattr(rc, "preferredLocalServiceIDs", None) or []))
    cfg.validate()
    return cfg.replicaNum, list(cfg.preferredLocalServiceIDs)


def as_code(e: MemCacheError | None) -> int:
    return errors.SUCCESS if e is None else e.code


def int_arg(name: str, v: Any, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise InvalidParameter(f"{name}: {v!r} is not an int in [{lo}, {hi}]")
