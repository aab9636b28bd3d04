"""MemCache KV connector for vLLM.

Select it with ``"kv_connector": "MemCacheConnector", "kv_connector_module_path": "memcache_vllm"``
in ``--kv-transfer-config``.
"""

from memcache_vllm.connector import MemCacheConnector

__all__ = ["MemCacheConnector"]
