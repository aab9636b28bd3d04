"""SGLang HiCache L3 storage backend ``npu_memcache`` on top of :mod:`memcache_core`.

* :class:`memcache_sglang.hicache_backend.NpuMemcacheStore` - the ``HiCacheStorage`` class.
* :func:`memcache_sglang.plugin.register` - the ``sglang.srt.plugins`` entry point that makes
  ``--hicache-storage-backend npu_memcache`` resolve to it.
* ``python -m memcache_sglang.start_meta_service --config_path F`` - the MetaService launcher that
  users of SGLang's built-in backend know.
* :mod:`memcache_sglang.testing` - real SGLang servers on the CPU joined to a MetaService, for the
  engine tests, the TTFT benchmark and ``examples/sglang/serve_cpu.py``.

Nothing here imports sglang or torch at package import time.
"""

__all__ = ["BACKEND_NAME", "BACKEND_MODULE", "BACKEND_CLASS"]

BACKEND_NAME = "npu_memcache"
BACKEND_MODULE = "memcache_sglang.hicache_backend"
BACKEND_CLASS = "NpuMemcacheStore"
