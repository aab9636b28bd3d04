"""``DistributedObjectStore`` against memcache_hybrid 1.3.0's Python API, method by method: the names,
the parameter names in order, and the defaults the wheel declares (transcribed from its bindings and
docs: memcache_python_api.md; the GVA calls as vllm-ascend's layer-wise backend calls them). A default
the reference does not state is not checked (``ANY``); integrations pass those arguments positionally."""

from __future__ import annotations

import inspect

import pytest

from memcache_core import AUTO, G2H, G2L, H2G, L2G, DistributedObjectStore, KeyInfo

ANY = object()
REQUIRED = inspect.Parameter.empty

# method -> [(parameter, default)] after ``self``
REFERENCE: dict[str, list[tuple[str, object]]] = {
    "setup": [("config", ANY)],
    "init": [("device_id", ANY), ("init_bm", True)],
    "close": [],
    "get_local_service_id": [],
    "register_buffer": [("ptr", REQUIRED), ("size", REQUIRED)],
    "unregister_buffer": [("ptr", REQUIRED), ("size", REQUIRED)],
    "put": [("key", REQUIRED), ("buf", REQUIRED), ("replicateConfig", ANY)],
    "put_batch": [("keys", REQUIRED), ("values", REQUIRED), ("replicateConfig", ANY)],
    "put_from": [("key", REQUIRED), ("ptr", REQUIRED), ("size", REQUIRED), ("direct", H2G), ("replicateConfig", ANY)],
    "batch_put_from": [("keys", REQUIRED), ("ptrs", REQUIRED), ("sizes", REQUIRED), ("direct", H2G),
                       ("replicateConfig", ANY)],
    "put_from_layers": [("key", REQUIRED), ("ptrs", REQUIRED), ("sizes", REQUIRED), ("direct", ANY),
                        ("replicateConfig", ANY)],
    "batch_put_from_layers": [("keys", REQUIRED), ("ptrs", REQUIRED), ("sizes", REQUIRED), ("direct", ANY),
                              ("replicateConfig", ANY)],
    "get": [("key", REQUIRED)],
    "get_batch": [("keys", REQUIRED)],
    "get_into": [("key", REQUIRED), ("ptr", REQUIRED), ("size", REQUIRED), ("direct", G2H)],
    "batch_get_into": [("keys", REQUIRED), ("ptrs", REQUIRED), ("sizes", REQUIRED), ("direct", G2H)],
    "get_into_layers": [("key", REQUIRED), ("ptrs", REQUIRED), ("sizes", REQUIRED), ("direct", ANY)],
    "batch_get_into_layers": [("keys", REQUIRED), ("ptrs", REQUIRED), ("sizes", REQUIRED), ("direct", ANY)],
    "is_exist": [("key", REQUIRED)],
    "batch_is_exist": [("keys", REQUIRED)],
    "remove": [("key", REQUIRED)],
    "remove_batch": [("keys", REQUIRED)],
    "remove_all": [],
    "get_key_info": [("key", REQUIRED), ("flag", ANY)],
    "batch_get_key_info": [("keys", REQUIRED), ("flag", ANY)],
    "batch_alloc": [("keys", REQUIRED), ("sizes", REQUIRED), ("media", 1), ("leaseTtlMs", 0)],
    "batch_copy": [("gva_ptrs", REQUIRED), ("buffer_ptrs", REQUIRED), ("sizes", REQUIRED), ("direct", REQUIRED),
                   ("flag", 0)],
    "batch_copy_layers": [("gva_ptrs", REQUIRED), ("buffer_ptrs", REQUIRED), ("sizes", REQUIRED),
                          ("direct", REQUIRED), ("flag", 0)],
    "batch_write_finish": [("keys", REQUIRED), ("results", REQUIRED)],
    "batch_add_lease": [("keys", REQUIRED), ("leaseTtlMs", 0)],
    "batch_remove_lease": [("keys", REQUIRED)],
    "prefetch": [("keys", REQUIRED), ("src_media", ANY), ("dst_media", ANY), ("flags", ANY)],
    "evict": [("keys", REQUIRED), ("src_media", ANY), ("dst_media", ANY), ("flags", ANY)],
}


@pytest.mark.parametrize("method", sorted(REFERENCE))
def test_method_matches_memcache_hybrid(method):
    params = list(inspect.signature(getattr(DistributedObjectStore, method)).parameters.values())[1:]
    want = REFERENCE[method]
    assert [p.name for p in params] == [n for n, _ in want], f"{method}: parameter names"
    for p, (name, default) in zip(params, want, strict=True):
        if default is REQUIRED:
            assert p.default is REQUIRED, f"{method}({name}) has a default; the reference has none"
        elif default is not ANY:
            assert p.default == default, f"{method}({name}) defaults to {p.default!r}, the reference to {default!r}"


def test_module_names_and_key_info_accessors():
    assert (L2G, G2L, G2H, H2G, AUTO) == (0, 1, 2, 3, 4)
    info = KeyInfo(10, [7], ["DRAM"], [0x1234])
    assert (info.size(), info.loc_list(), info.type_list(), info.gva_list()) == (10, [7], ["DRAM"], [0x1234])
