"""Other host layouts through a real SGLang server, and layout isolation in one shared pool.

* ``page_first`` (kernel IO): one object per page, K and V pieces laid out page-first.
* ``page_head`` with ``tp_lcm_size`` 2 at TP 1: SGLang splits each page's heads in two
  (``should_split_heads``), the backend stores one object per head group, keyed by the head-group
  rank a TP-2 server would use.
* ``--hicache-storage-backend dynamic`` (our class named in the extra config) without
  ``interface_v1``: ``layer_first`` host layout and SGLang's generic copy path, i.e. the legacy
  ``batch_get``/``batch_set``/``batch_exists`` calls with whole flat pages.
The servers share one MetaService, one after the other: each later one must not hit what the
first wrote (different layout -> different bytes -> different namespace), then restores its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import serve_cpu
from conftest import FULL_PAGES, flush, generate, pool_keys, prompt, start, wait_for_new_keys

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

LAYOUTS = {
    "page_first": ([], ["--hicache-mem-layout", "page_first", "--hicache-io-backend", "kernel"], 1),
    "page_head_split": ({"tp_lcm_size": 2},
                        ["--hicache-mem-layout", "page_head", "--hicache-io-backend", "kernel"], 2),
    # `dynamic` without interface_v1: SGLang's generic copy path drives the legacy calls.
    "dynamic_copy_path": ({"backend_name": "memcache", "module_path": "memcache_sglang.hicache_backend",
                           "class_name": "NpuMemcacheStore"},
                          ["--hicache-storage-backend", "dynamic", "--hicache-mem-layout", "layer_first"], 1),
}
SHARED_PROMPT = 21


@pytest.fixture(scope="module")
def written_by_other_layout() -> Iterator[dict]:
    yield {}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_round_trip(layout: str, meta: serve_cpu.MetaHandle, model: str, tmp_path: Path,
                           written_by_other_layout: dict) -> None:
    """Scenario: layout X restores its own writes; it never hits another layout's objects."""
    extra, args, objects_per_page = LAYOUTS[layout]
    server = start(meta, model, tmp_path, layout, extra_config=dict(extra or {}), extra_args=args)
    try:
        log = Path(server.log_path).read_text()
        assert f"{objects_per_page} object(s) per page" in log, "unexpected page split"
        assert "memcache_sglang.hicache_backend" in log
        shared = prompt(SHARED_PROMPT)
        ids = shared
        if written_by_other_layout:
            before = pool_keys(meta)
            other = generate(server, shared)
            assert other["storage"] == 0, f"{layout} hit objects written under another layout: {other}"
            assert other["text"] == written_by_other_layout["text"]
            wait_for_new_keys(meta, before, objects_per_page * FULL_PAGES)  # its own copy
            ids = prompt(SHARED_PROMPT + 1)
        before = pool_keys(meta)
        cold = generate(server, ids)
        new = wait_for_new_keys(meta, before, objects_per_page * FULL_PAGES)
        if layout == "dynamic_copy_path":
            assert all(k.endswith(".flat") for k in new), sorted(new)[:3]
        if objects_per_page == 2:
            shards = {k.rsplit(".", 1)[-1] for k in new}
            assert shards == {"r0p0c0", "r1p0c0"}, shards
        if not written_by_other_layout:
            written_by_other_layout["text"] = cold["text"]
        flush(server)
        restored = generate(server, ids)
        assert restored["device"] == 0 and restored["host"] == 0, restored
        assert restored["storage"] >= (FULL_PAGES - 1) * 128, restored
        assert restored["text"] == cold["text"]
    finally:
        server.stop()
