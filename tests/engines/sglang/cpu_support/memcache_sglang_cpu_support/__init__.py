"""CPU-only scaffolding that lets stock SGLang 0.5.23 run HiCache on a machine without a GPU.

Test and example support only; it is never imported by the ``memcache_sglang`` backend.
It is put on the SGLang test environment's path by ``.ci/sglang_env.sh`` (a ``.pth`` file) and
contains:

* stand-in ``torchvision`` and ``sgl_kernel`` packages (:mod:`.stubs`), because PyPI only has CUDA
  builds of the first and none of the second for a CPU torch;
* a ``sglang.srt.plugins`` entry point (:mod:`.plugin`) that gives the host KV pool plain
  (unpinned) memory and torch-indexing host<->device transfer functions.
"""
