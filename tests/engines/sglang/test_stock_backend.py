"""SGLang's own built-in ``NpuMemcacheStore`` (unchanged, from the installed sglang) on memcache_core.

Our plugin is switched off (``SGLANG_PLUGINS`` lists only the CPU scaffolding), so the stock class
from ``sglang.srt.mem_cache.storage.npu_memcache`` is used; its ``from memcache_hybrid import ...``
resolves to a test-only alias of memcache_core (``stock_compat/``). The MetaService is started
with SGLang's own launcher too. Proves the memcache_hybrid-compatible surface is real.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import FULL_PAGES, flush, generate, pool_keys, prompt, wait_for_new_keys
from memcache_sglang import testing as harness

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

SHIM = str(Path(__file__).resolve().parent / "stock_compat")
STOCK_ENV = {
    "PYTHONPATH": os.pathsep.join(p for p in (SHIM, os.environ.get("PYTHONPATH")) if p),
    "SGLANG_PLUGINS": "memcache_cpu_support",
}
STOCK_LAUNCHER = "sglang.srt.mem_cache.storage.npu_memcache.start_meta_service"


def test_stock_npu_memcache_store_on_memcache_core(model: str, tmp_path: Path) -> None:
    """Scenario: stock backend writes through, /flush_cache, restores from L3 with the same text."""
    meta = harness.start_meta(tmp_path / "meta", sys.executable, launcher=STOCK_LAUNCHER, env=STOCK_ENV)
    try:
        server = harness.start_server(harness.free_port(), meta, model=model,
                                      log_path=tmp_path / "stock_server.log", env=STOCK_ENV)
        try:
            log = Path(server.log_path).read_text()
            assert "sglang.srt.mem_cache.storage.npu_memcache" in log, "the stock class was not used"
            assert "memcache_sglang.hicache_backend" not in log

            ids = prompt(11)
            before = pool_keys(meta)
            cold = generate(server, ids)
            assert cold["storage"] == 0 and cold["device"] == 0, cold
            written = wait_for_new_keys(meta, before, 2 * FULL_PAGES)  # stock: one k and one v per page
            assert all(k.endswith(("_0_k", "_0_v")) for k in written), sorted(written)[:4]

            flush(server)
            restored = generate(server, ids)
            assert restored["backend"] == "NpuMemcacheStore"
            assert restored["device"] == 0 and restored["host"] == 0, restored
            assert restored["storage"] >= (FULL_PAGES - 1) * 128, restored
            assert restored["text"] == cold["text"]
        finally:
            server.stop()
    finally:
        meta.stop()
