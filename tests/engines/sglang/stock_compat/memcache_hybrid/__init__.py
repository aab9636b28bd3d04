"""Test-only alias: the ``memcache_hybrid`` import name served by ``memcache_core``.

Lets SGLang's own built-in ``npu_memcache`` backend and its ``start_meta_service`` run, unchanged,
on memcache_core's memcache_hybrid-compatible API. It lives in the test tree and is put on
``PYTHONPATH`` only for the processes of that one test: shipping a top-level ``memcache_hybrid``
would shadow (or be shadowed by) Ascend's real package of that name.
"""

from memcache_core import (  # noqa: F401
    AUTO,
    G2H,
    G2L,
    H2G,
    L2G,
    DistributedObjectStore,
    KeyInfo,
    LocalConfig,
    MetaConfig,
    MetaService,
    ReplicateConfig,
)
