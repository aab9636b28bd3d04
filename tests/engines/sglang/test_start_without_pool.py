"""Failures are misses from the first second (issue 21, item 4): an SGLang server whose MetaService
is down at start-up starts anyway, serves misses, joins the pool in the background when it comes
back, and its pages are written to and restored from the pool from then on; SGLang's /metrics
shows the join (attempts, failures, joined, misses served meanwhile). A store opened against a
MetaService that never answers gives up within the backend's 5 s client timeout."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import FULL_PAGES, generate, pool_keys, prompt, request, start, wait_for_new_keys
from memcache_sglang import testing as harness
from memcache_sglang.hicache_backend import CLIENT_TIMEOUT_S, NpuMemcacheStore
from prometheus_client import REGISTRY
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from memcache_core.testing import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

JOIN_SERIES = ("memcache_sglang_join_attempts_total", "memcache_sglang_join_failures_total",
               "memcache_sglang_joined", "memcache_sglang_unjoined_misses_total")
# A store open against a MetaService that never answers costs one client timeout (5 s) plus the
# set-up around it; the bound is loose for a loaded machine and still far below the core's 60 s.
HUNG_OPEN_BOUND_S = 30.0


def join_metrics(server: harness.ServerHandle) -> dict[str, float]:
    """Rank 0's join series from SGLang's /metrics (absent ones missing from the result)."""
    text = request(server, "GET", "/metrics", idempotent=True, timeout=30).text
    found = {}
    for name in JOIN_SERIES:
        m = re.search(rf'^{name}{{rank="0"}} (\S+)$', text, re.MULTILINE)
        if m:
            found[name] = float(m.group(1))
    return found


def test_server_starts_without_the_pool_and_joins_when_it_is_back(model: str, tmp_path: Path) -> None:
    meta = harness.start_meta(tmp_path / "meta")
    meta.stop()
    # Retries at most 1 s apart (30 s by default): the join follows the MetaService's return at once.
    server = start(meta, model, tmp_path, "no_pool",
                   extra_config={"client_timeout_seconds": 2, "join_retry_max_seconds": 1},
                   extra_args=["--enable-metrics"])
    try:
        ids = prompt(71)
        cold = generate(server, ids)
        assert cold["storage"] == 0, cold
        log = Path(server.log_path).read_text(errors="replace")
        assert log.count("cannot join the pool at start-up") >= 1, harness.log_tail(server.log_path)
        down = join_metrics(server)
        assert down.keys() == set(JOIN_SERIES), down
        assert down["memcache_sglang_joined"] == 0, down
        assert down["memcache_sglang_join_failures_total"] >= 1, down
        assert down["memcache_sglang_join_attempts_total"] >= down["memcache_sglang_join_failures_total"], down
        # the cold request's pages were asked of the backend and answered as misses
        assert down["memcache_sglang_unjoined_misses_total"] >= FULL_PAGES - 1, down
        meta.start()
        wait_for(lambda: "joined the pool after" in Path(server.log_path).read_text(errors="replace"),
                 120, "the server to join the pool in the background", interval_s=0.5)
        # the log line comes just before the backend takes the store: wait for the gauge, too
        wait_for(lambda: join_metrics(server).get("memcache_sglang_joined") == 1, 30,
                 lambda: f"memcache_sglang_joined to be 1: {join_metrics(server)}", interval_s=0.5)
        up = join_metrics(server)
        # every attempt but the last one failed
        assert up["memcache_sglang_join_attempts_total"] == up["memcache_sglang_join_failures_total"] + 1, up
        with ThreadPoolExecutor(1) as pool:
            # The fresh server starts (it joins after the late joiner, as a second server of a
            # deployment does) while the late joiner serves and writes a prompt.
            starting = pool.submit(start, meta, model, tmp_path, "fresh")
            try:
                before = pool_keys(meta)
                other = prompt(72)
                first = generate(server, other)
                wait_for_new_keys(meta, before, FULL_PAGES)
                after = join_metrics(server)
                assert after["memcache_sglang_unjoined_misses_total"] == \
                    up["memcache_sglang_unjoined_misses_total"], (up, after)   # misses of a joined backend
            except BaseException:
                if starting.exception() is None:
                    starting.result().stop()
                raise
        fresh = starting.result()
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


@pytest.fixture
def hung_url() -> Iterator[str]:
    """A real listening socket that accepts connections and never answers (a hung MetaService)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"tcp://127.0.0.1:{s.getsockname()[1]}"


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name, {"rank": "0"}) or 0.0


def test_store_open_against_a_hung_meta_service_is_bounded(hung_url: str) -> None:
    """Scenario: the backend opens its store with no client_timeout_seconds set, against a
    MetaService that accepts and never answers -> it gives up within the default 5 s client timeout
    (not the core's 60 s), serves misses, and counts the failed join.

    The clock is the negative control: with the core's default the open alone would take 60 s."""
    assert CLIENT_TIMEOUT_S == 5.0
    before = {name: sample(name) for name in JOIN_SERIES}
    sc = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=None,
        extra_config={"meta_service_url": hung_url, "config_store_url": hung_url, "init_bm": False,
                      "dram_size": "0", "protocol": "host_shm"})
    started = time.monotonic()
    backend = NpuMemcacheStore(sc)
    try:
        took = time.monotonic() - started
        assert backend.store is None
        assert CLIENT_TIMEOUT_S <= took < HUNG_OPEN_BOUND_S, f"the store open took {took:.1f}s"
        assert backend.exists("00" * 32) is False
        assert sample("memcache_sglang_joined") == 0
        assert sample("memcache_sglang_unjoined_misses_total") - before["memcache_sglang_unjoined_misses_total"] == 1
        assert sample("memcache_sglang_join_failures_total") - before["memcache_sglang_join_failures_total"] >= 1
        assert sample("memcache_sglang_join_attempts_total") - before["memcache_sglang_join_attempts_total"] >= 1
    finally:
        backend.close()
