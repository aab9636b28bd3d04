"""The optional native copy loop (memcache_core/transfer/copyloop.c); everything else is in pyproject.toml.

A plain C library without the Python API, loaded with ctypes (transfer/native.py). ``optional``: where
no compiler is found the install goes on without it and the copies run the pure-Python loop.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("memcache_core.transfer._copyloop", ["memcache_core/transfer/copyloop.c"],
                             extra_compile_args=["-O2"], optional=True),
                   Extension("memcache_core.rpc._frameloop", ["memcache_core/rpc/frameloop.c"], depends=["memcache_core/native/blake2b.h"], extra_compile_args=["-O2"], optional=True)])
