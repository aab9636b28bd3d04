"""Stand-in ``sgl_kernel`` for the CPU SGLang test environment (see memcache_sglang_cpu_support).

Every name imports; calling one raises. With no ``torch.ops.sgl_kernel`` ops registered, SGLang's
layers use their native torch paths on CPU.
"""

import sys

from memcache_sglang_cpu_support import stubs

__version__ = "0.0.0+memcache.stub"
# SGLang imports these inside `try: ... except ImportError` and has pure-torch fallbacks.
stubs.install(sys.modules[__name__], stubs.raising_function, missing=("scalar_type",))
