"""Stand-in ``torchvision`` for the CPU SGLang test environment (see memcache_sglang_cpu_support)."""

import sys

from memcache_sglang_cpu_support import stubs

__version__ = "0.0.0+memcache.stub"
stubs.install(sys.modules[__name__], stubs.placeholder_class)
