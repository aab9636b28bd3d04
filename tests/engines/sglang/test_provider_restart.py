"""The recommended deployment: a standalone provider (``memcache local-service``) holds the pool and
SGLang servers join as pure clients (``init_bm: false``). A server that writes a prompt's pages and
is stopped (a deploy) leaves them in the provider; a fresh server restores them from L3 with the
first server's output."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    FULL_PAGES,
    assert_a_fresh_server_restores,
    generate,
    pool_keys,
    prompt,
    start,
    wait_for_new_keys,
)
from memcache_sglang import testing as harness

from memcache_core.testing import start_local_service

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CLIENT = {"client_timeout_seconds": 5, "init_bm": False, "dram_size": "0"}


@contextlib.contextmanager
def provider(meta: harness.MetaHandle, workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    secret_path = json.loads(Path(meta.config_path).read_text()).get("auth_secret_path", "")
    config = {"meta_service_url": meta.meta_service_url, "config_store_url": meta.config_store_url,
              "protocol": "host_shm", "dram_size": "512MB", "auth_secret_path": secret_path}
    proc, _ = start_local_service(config, workdir, lambda: meta.admin("/get_all_segments")["segments"],
                                  name="provider", timeout_s=60)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_restarted_server_finds_its_pages_in_the_provider(meta: harness.MetaHandle, model: str,
                                                           tmp_path: Path) -> None:
    ids = prompt(60)
    with provider(meta, tmp_path):
        first = start(meta, model, tmp_path, "client_1", extra_config=CLIENT)
        try:
            before = pool_keys(meta)
            cold = generate(first, ids)
            assert cold["device"] == cold["host"] == cold["storage"] == 0, cold
            wait_for_new_keys(meta, before, FULL_PAGES)
            warm = generate(first, ids)
            assert warm["device"] >= (FULL_PAGES - 1) * 128, warm
        finally:
            first.stop()
        assert warm["text"] == cold["text"]
        assert_a_fresh_server_restores(meta, model, tmp_path, "client_2", ids, warm["text"], extra_config=CLIENT)
