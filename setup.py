"""The optional native loops: the copy loop (memcache_core/transfer/copyloop.c), the data server's
request loop (memcache_core/transfer/dataloop.c) and the MetaService's frame loop
(memcache_core/rpc/frameloop.c); everything else is in pyproject.toml.

The first two are plain C libraries without the Python API, loaded with ctypes (transfer/native.py,
transfer/dataloop.py); the frame loop is a CPython extension (rpc/pump.py; docs/design.md says why).
``optional``: where no compiler is found the install goes on without them and the pure-Python loops run.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("memcache_core.transfer._copyloop", ["memcache_core/transfer/copyloop.c"],
                             extra_compile_args=["-O2"], optional=True),
                   Extension("memcache_core.transfer._dataloop", ["memcache_core/transfer/dataloop.c"],
                             depends=["memcache_core/native/blake2b.h"], extra_compile_args=["-O2"],
                             optional=True),
                   Extension("memcache_core.rpc._frameloop", ["memcache_core/rpc/frameloop.c"],
                             depends=["memcache_core/native/blake2b.h"], extra_compile_args=["-O2"],
                             optional=True)])
