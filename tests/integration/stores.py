"""The pool in child processes for the multi-process suites: ``StoreProcess`` (a LocalService driven
over stdin/stdout) and the ``meta`` / ``stores`` / ``short_heartbeat`` fixtures. Imported as
``tests.integration.stores`` only, by the conftest files (which register the fixtures) and by the tests; a
conftest is never imported by a test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from memcache_core import DistributedObjectStore
from memcache_core.testing import MetaServiceProcess, die_with_parent, running_meta_service, started

WORKER = os.path.join(os.path.dirname(__file__), "store_worker.py")

# The real DeepSeek-R1-shaped block: 61 x 128 KiB + 61 x 16 KiB = 8,784 KiB in 122 pieces.
DSR1_LAYOUT = [128 << 10] * 61 + [16 << 10] * 61


class StoreProcess:
    """A LocalService in a child process, driven over stdin/stdout."""

    def __init__(self, ms: MetaServiceProcess, **cfg: Any) -> None:
        conf = {"meta_service_url": ms.meta_service_url, "config_store_url": ms.config_store_url,
                "protocol": "host_shm", "dram_size": "256MB", "client_timeout_seconds": 5,
                "heartbeat_interval_ms": 200, **cfg}
        self.proc = subprocess.Popen([sys.executable, WORKER, json.dumps(conf)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1,
                                     preexec_fn=die_with_parent())
        hello = json.loads(self.proc.stdout.readline() or '{"ready": false}')  # type: ignore[union-attr]
        if not hello.get("ready"):
            self.proc.kill()
            raise RuntimeError(f"store process failed to start: {hello}")

    def __call__(self, op: str, **kw: Any) -> dict[str, Any]:
        self.begin(op, **kw)
        return self.end()

    def begin(self, op: str, **kw: Any) -> None:
        """Send a command without waiting for its answer (``end`` reads it): the worker may stop meanwhile."""
        assert self.proc.stdin
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def end(self) -> dict[str, Any]:
        """The answer to the command ``begin`` sent."""
        assert self.proc.stdout
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("store process died")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self("close")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def answers_again(store: StoreProcess, key: str) -> bool:
    """``store``'s MetaService answers it again: ``key``, which the pool holds, exists for it. After a
    MetaService restart a client's calls fail fast (-3017) until one of them gets through."""
    return bool(store("exist", keys=[key])["codes"] == [1])


# A member silent this long is declared dead by the ``meta`` fixture's MetaService: long enough that a
# live member stalled by a loaded machine (several seconds at a load of 20 on 2 cores) stays a member.
HEARTBEAT_TIMEOUT_MS = 10_000


@pytest.fixture
def short_heartbeat() -> int:
    """Requested beside ``meta`` by a test that kills or freezes a member and waits for its death:
    that ``meta`` declares a member dead after this many ms without a heartbeat (the default,
    ``HEARTBEAT_TIMEOUT_MS``, would make each such wait last seconds longer)."""
    return 1500


@pytest.fixture
def meta(request: pytest.FixtureRequest) -> Iterator[MetaServiceProcess]:
    timeout_ms = (request.getfixturevalue("short_heartbeat") if "short_heartbeat" in request.fixturenames
                  else HEARTBEAT_TIMEOUT_MS)
    loop = {"frame_loop": request.getfixturevalue("frame_loop")} if "frame_loop" in request.fixturenames else {}
    with running_meta_service(heartbeat_timeout_ms=timeout_ms, lease_ttl_ms=2000, **loop) as ms:
        yield ms


@pytest.fixture
def stores(meta: MetaServiceProcess) -> Iterator[Any]:
    with started(lambda **cfg: StoreProcess(meta, **cfg), StoreProcess.stop) as start:
        yield start


@contextlib.contextmanager
def stalled_reads(store: DistributedObjectStore, meanwhile: Callable[[], None]) -> Iterator[None]:
    """Fault injection: within the block, every copy ``store`` reads from the pool first runs
    ``meanwhile()`` (the reader stalls between its lookup and its copy while the pool changes).
    No public API can stall a read there: this is the one place the tests reach into the store's
    LocalService."""
    engine = store._service().engine
    assert engine is not None
    real_read = engine.read

    def stalled(ops: Any) -> Any:
        meanwhile()
        return real_read(ops)

    engine.read = stalled  # type: ignore[method-assign]
    try:
        yield
    finally:
        engine.read = real_read  # type: ignore[method-assign]
