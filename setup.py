"""The optional native loops: the copy loop (memcache_core/transfer/copyloop.c) and the data server's
request loop (memcache_core/transfer/dataloop.c); everything else is in pyproject.toml.

Plain C libraries without the Python API, loaded with ctypes (transfer/native.py, transfer/dataloop.py).
``optional``: where no compiler is found the install goes on without them and the pure-Python loops run.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("memcache_core.transfer._copyloop", ["memcache_core/transfer/copyloop.c"],
                             extra_compile_args=["-O2"], optional=True),
                   Extension("memcache_core.transfer._dataloop", ["memcache_core/transfer/dataloop.c"],
                             depends=["memcache_core/native/blake2b.h"], extra_compile_args=["-O2"],
                             optional=True)])
