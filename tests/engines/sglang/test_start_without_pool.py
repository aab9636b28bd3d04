"""Failures are misses from the first second (issue 21, item 4): an SGLang server whose MetaService
is down at start-up starts anyway, serves misses, joins the pool in the background when it comes
back, and its pages are written to and restored from the pool from then on."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FULL_PAGES, generate, pool_keys, prompt, start, wait_for_new_keys
from memcache_sglang import testing as harness

from memcache_core.testing import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def test_server_starts_without_the_pool_and_joins_when_it_is_back(model: str, tmp_path: Path) -> None:
    meta = harness.start_meta(tmp_path / "meta")
    meta.stop()
    server = start(meta, model, tmp_path, "no_pool", extra_config={"client_timeout_seconds": 2})
    try:
        ids = prompt(71)
        cold = generate(server, ids)
        assert cold["storage"] == 0, cold
        log = Path(server.log_path).read_text(errors="replace")
        assert log.count("cannot join the pool at start-up") >= 1, harness.log_tail(server.log_path)
        meta.start()
        wait_for(lambda: "joined the pool after" in Path(server.log_path).read_text(errors="replace"),
                 120, "the server to join the pool in the background", interval_s=0.5)
        before = pool_keys(meta)
        other = prompt(72)
        first = generate(server, other)
        wait_for_new_keys(meta, before, FULL_PAGES)
        fresh = start(meta, model, tmp_path, "fresh")
        try:
            got = generate(fresh, other)
            assert got["storage"] >= (FULL_PAGES - 1) * 128, got
            assert got["text"] == first["text"]
        finally:
            fresh.stop()
        failures = Path(server.log_path).read_text(errors="replace").count("cannot join the pool")
        assert failures == 1, "the outage is logged once, not once per attempt"
    finally:
        server.stop()
        meta.stop()
