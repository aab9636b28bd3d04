"""MemCache for Python: a distributed KV-cache pool for LLM inference.

The public API is memcache_hybrid's: ``MetaConfig``/``MetaService`` run the control plane,
``LocalConfig``/``DistributedObjectStore`` join the pool and do batched put / get / exist.
Names are imported on first use, so the MetaService process never loads the client side (numpy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import LocalConfig, MetaConfig, ReplicateConfig
    from .errors import MemCacheError
    from .local.store import DistributedObjectStore, open_store
    from .local.store_codes import AUTO, G2H, G2L, H2G, L2G, KeyInfo
    from .meta_service import MetaService

_WHERE = {"LocalConfig": "config", "MetaConfig": "config", "ReplicateConfig": "config",
          "MemCacheError": "errors", "MetaService": "meta_service",
          "DistributedObjectStore": "local.store", "open_store": "local.store",
          **{n: "local.store_codes" for n in ("AUTO", "G2H", "G2L", "H2G", "L2G", "KeyInfo")}}

__all__ = ["AUTO", "G2H", "G2L", "H2G", "L2G", "DistributedObjectStore", "KeyInfo", "LocalConfig",
           "MemCacheError", "MetaConfig", "MetaService", "ReplicateConfig", "open_store"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'memcache_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
