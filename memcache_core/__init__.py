"""MemCache for Python: a distributed KV-cache pool for LLM inference.

The public API is memcache_hybrid's: ``MetaConfig``/``MetaService`` run the control plane,
``LocalConfig``/``DistributedObjectStore`` join the pool and do batched put / get / exist.
"""

from .config import LocalConfig, MetaConfig, ReplicateConfig
from .errors import MemCacheError
from .local.store import AUTO, G2H, G2L, H2G, L2G, DistributedObjectStore, KeyInfo
from .meta_service import MetaService

__all__ = ["AUTO", "G2H", "G2L", "H2G", "L2G", "DistributedObjectStore", "KeyInfo", "LocalConfig",
           "MemCacheError", "MetaConfig", "MetaService", "ReplicateConfig"]
__version__ = "0.1.0"
