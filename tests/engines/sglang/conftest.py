"""Fixtures for the SGLang engine tests: real MetaService, real SGLang servers, tiny local model.

Run with the SGLang environment's python (``.ci/sglang_env.sh`` prints it):

    "$(bash .ci/sglang_env.sh | tail -1)/bin/python" -m pytest tests/engines/sglang -m engine
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import pluggy

pytest.importorskip("sglang", reason="needs the SGLang test environment (.ci/sglang_env.sh)")
import requests  # noqa: E402
from memcache_sglang import testing as harness  # noqa: E402

from memcache_core.testing import wait_for  # noqa: E402

PROMPT_TOKENS = 3200
PAGE = 128
FULL_PAGES = PROMPT_TOKENS // PAGE
REQUEST_TIMEOUT_S = 240
ADMIN_KEY = "memcache-test-admin"  # servers of the main module run with --admin-api-key
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # accepted (and ignored) by servers without one
BACKUP_TIMEOUT_S = 60
RANDOM_SEED = 0
PORT_ATTEMPTS = 3


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 32000) for _ in range(PROMPT_TOKENS)]


# Servers started by start() and not stopped yet, plus those stopped during the running test: their
# state and log tails are attached to the report of a failing test (pytest_runtest_makereport).
_live_servers: list[harness.ServerHandle] = []
_stopped_in_test: list[harness.ServerHandle] = []

ADMIN_RETRIES = 3


class ServerDied(AssertionError):
    """A request failed because the server process is gone (not a connection race)."""


def request(server: harness.ServerHandle, method: str, path: str, *, idempotent: bool,
            timeout: float = 60, **kw: Any) -> requests.Response:
    """One HTTP call on a fresh connection (``Connection: close``: no keep-alive to go stale).

    A connection error is resolved, never guessed: if the server process has exited the call
    fails with ``ServerDied`` (exit status and log tail); if it is alive, an idempotent call is
    retried a few times and any other call fails with the server's state attached.
    """
    headers = {**kw.pop("headers", {}), "Connection": "close"}
    for attempt in range(ADMIN_RETRIES + 1):
        try:
            with requests.Session() as session:
                return session.request(method, f"{server.url}{path}", headers=headers, timeout=timeout, **kw)
        except requests.ConnectionError as exc:
            if server.exit_status() is not None:
                raise ServerDied(f"{method} {path}: {exc}\n{server.describe()}") from exc
            if not idempotent or attempt == ADMIN_RETRIES:
                raise AssertionError(f"{method} {path} failed on a live server: {exc}\n"
                                     f"{server.describe()}") from exc
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def generate(server: harness.ServerHandle, ids: list[int], max_new_tokens: int = 8) -> dict[str, Any]:
    """Greedy /generate; returns text, cached token details (device/host/storage) and latency."""
    start = time.monotonic()
    r = request(server, "POST", "/generate", idempotent=False, timeout=REQUEST_TIMEOUT_S, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
    r.raise_for_status()
    body = r.json()
    details = body["meta_info"].get("cached_tokens_details") or {}
    return {"text": body["text"], "device": details.get("device", 0), "host": details.get("host", 0),
            "storage": details.get("storage", 0), "backend": details.get("storage_backend"),
            "seconds": time.monotonic() - start}


def flush(server: harness.ServerHandle) -> None:
    """Drop device and host caches (L1/L2); L3 is untouched. Retries while requests drain."""
    last: list[Any] = []

    def flushed() -> bool:
        last[:] = [request(server, "POST", "/flush_cache", idempotent=True, timeout=30, headers=ADMIN)]
        return last[0].status_code == 200

    wait_for(flushed, 30, lambda: f"/flush_cache to be accepted: {last[0].status_code} {last[0].text}",
             interval_s=0.5)


def generate_from_storage(server: harness.ServerHandle, ids: list[int], pages: int = FULL_PAGES,
                          page: int = PAGE) -> dict[str, Any]:
    """generate() on a server whose device and host caches hold none of ``ids``: every full page but
    the last must come from L3, the pool. Returns generate()'s result."""
    got = generate(server, ids)
    assert got["device"] == 0 and got["host"] == 0, got
    assert got["storage"] >= (pages - 1) * page, got
    return got


def assert_a_fresh_server_restores(meta: harness.MetaHandle, model: str, log_dir: Path, name: str,
                                   ids: list[int], text: str, **kw: Any) -> None:
    """A server started now (nothing of ``ids`` in its device or host cache) restores them from L3
    (generate_from_storage) and answers ``text``; it is stopped afterwards."""
    server = start(meta, model, log_dir, name, **kw)
    try:
        assert generate_from_storage(server, ids)["text"] == text
    finally:
        server.stop()


def pool_keys(meta: harness.MetaHandle) -> set[str]:
    return set(meta.admin("/get_all_keys")["keys"])


def wait_for_new_keys(meta: harness.MetaHandle, before: set[str], count: int,
                      timeout_s: float = BACKUP_TIMEOUT_S) -> set[str]:
    """Wait until write-through has committed at least ``count`` new objects; return them."""
    wait_for(lambda: len(pool_keys(meta) - before) >= count, timeout_s,
             lambda: f"{count} new objects (only {len(pool_keys(meta) - before)} within {timeout_s}s)",
             interval_s=0.25)
    time.sleep(0.5)  # let the last batch of this backup land too (nothing tells when it has)
    return pool_keys(meta) - before


# Server starts per module, roughly what a module costs. CI runs this suite two modules at a time
# (pytest-xdist: ``-n 2 --dist loadfile --no-loadscope-reorder``, modules handed out in this order
# rather than by their number of tests): the costliest first, so that neither worker is left with
# a long module at the end. A module not listed counts as one start.
MODULE_STARTS = {"test_default_deployment.py": 6, "test_namespace.py": 4, "test_layouts.py": 5,
                 "test_npu_memcache_backend.py": 3, "test_start_without_pool.py": 2,
                 "test_provider_restart.py": 2, "test_restart_first_request.py": 2, "test_disk_tier.py": 1, "test_stock_backend.py": 1,
                 "test_identity.py": 0, "test_keys_and_config.py": 0}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -MODULE_STARTS.get(item.path.name, 1))  # stable: a module keeps its order


@pytest.fixture(scope="session")
def model() -> str:
    return harness.ensure_model(sys.executable)


@pytest.fixture(scope="module")
def meta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.MetaHandle]:
    handle = harness.start_meta(tmp_path_factory.mktemp("meta"))
    try:
        yield handle
    finally:
        handle.stop()


def start(meta: harness.MetaHandle, model: str, log_dir: Path, name: str, **kw: Any) -> harness.ServerHandle:
    # Every server seeds Python's random the same way, as engines do: identities drawn from it collide.
    # Admission waits for a prefetch to complete: the default "timeout" policy (1 s plus 0.25 s per
    # 1k tokens) drops restores on this loaded 2-core machine, and the tests assert full restores.
    kw["extra_args"] = ["--random-seed", str(RANDOM_SEED), "--hicache-storage-prefetch-policy", "wait_complete",
                        *kw.get("extra_args", [])]
    for attempt in range(PORT_ATTEMPTS):
        log_path = log_dir / (f"{name}.log" if attempt == 0 else f"{name}.{attempt}.log")
        try:
            server = harness.start_server(harness.free_port(), meta, model=model, log_path=log_path, **kw)
            break
        except harness.PortTaken:  # other test runs on this machine pick free ports too
            if attempt == PORT_ATTEMPTS - 1:
                raise
    _live_servers.append(server)
    stop = server.stop

    def stop_and_forget() -> None:
        stop()
        if server in _live_servers:
            _live_servers.remove(server)
            _stopped_in_test.append(server)

    server.stop = stop_and_forget  # type: ignore[method-assign]
    return server


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo
                               ) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    """On any failure, say for every server involved whether it is alive or died, with its log tail."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in [*_live_servers, *_stopped_in_test]:
            report.sections.append((f"server :{server.port}", server.describe()))
    if report.when == "teardown":
        _stopped_in_test.clear()
