"""``sglang.srt.plugins`` entry point: route ``--hicache-storage-backend npu_memcache`` to us.

SGLang calls every general plugin first thing in each of its processes, the scheduler
subprocesses included, before the storage backend is built. Re-registering the name keeps every
name-based behaviour of SGLang (zero-copy v1 IO, layout rewrite, host allocator) intact. It also
hooks SGLang's weight-update path so that the key namespace follows the served weights
(:mod:`memcache_sglang.weight_updates`).
"""

from __future__ import annotations

import logging

from memcache_sglang import BACKEND_CLASS, BACKEND_MODULE, BACKEND_NAME
from memcache_sglang.weight_updates import HOOK_TARGET, install_hook

logger = logging.getLogger(__name__)


def register() -> None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    StorageBackendFactory.register_backend(BACKEND_NAME, BACKEND_MODULE, BACKEND_CLASS)
    install_hook()
    logger.info("HiCache storage backend %r -> %s.%s; weight updates observed at %s", BACKEND_NAME,
                BACKEND_MODULE, BACKEND_CLASS, HOOK_TARGET)
