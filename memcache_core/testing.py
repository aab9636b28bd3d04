"""Start real MemCache processes for tests, examples and benchmarks.

``running_meta_service()`` picks free ports, starts a MetaService process, waits for its /health
(with a deadline; a process that died is never counted as started) and always terminates it.
``start_local_service()`` starts a standalone provider and waits for its join; ``wait_for()`` polls
for a state (never a fixed sleep); ``started()`` is a fixture's factory that stops what it made;
``mapped_segment()`` maps a segment file from outside its owner (bit rot, a late writer);
``die_with_parent()`` makes every server a test starts die with the test's process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import mmap
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .rpc import FrameServer, RpcClient

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout_s: float, what: str | Callable[[], str],
             interval_s: float = 0.05) -> T:
    """Poll ``cond()`` until it returns a true value, and return that value; fail naming ``what``
    after ``timeout_s`` (never a fixed sleep). ``what`` may be a function, called on the timeout to
    say how far the wait got; ``cond`` may raise to stop the wait at once (a process it waits on
    died)."""
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(interval_s)
    return got


@contextlib.contextmanager
def polling(server: FrameServer, interval_s: float = 0.05) -> Iterator[FrameServer]:
    """``server`` polled on a thread for the block; then the thread is stopped and the server closed."""
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            server.poll(interval_s)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join()
        server.close()


@contextlib.contextmanager
def mapped_segment(path: str) -> Iterator[mmap.mmap]:
    """A segment file mapped read-write from outside its owner, to play bit rot or a late writer."""
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as m:
            yield m
    finally:
        os.close(fd)


@contextlib.contextmanager
def started(make: Callable[..., T], stop: Callable[[T], object]) -> Iterator[Callable[..., T]]:
    """A factory for the block (a fixture's ``start``): each thing ``make`` returns is kept and
    stopped, in the order made, when the block ends."""
    made: list[T] = []

    def start(*args: Any, **kw: Any) -> T:
        made.append(make(*args, **kw))
        return made[-1]

    try:
        yield start
    finally:
        for thing in made:
            stop(thing)


def make_tls_files(directory: str) -> dict[str, Any]:
    """A throw-away CA and one member certificate signed by it (needs the ``openssl`` command).

    Returns the LocalConfig/MetaConfig keys ``tls_enable``, ``tls_ca_path``, ``tls_cert_path``,
    ``tls_key_path``.
    """
    ca_key, ca, key, csr, cert = (os.path.join(directory, n) for n in
                                  ("ca.key", "ca.pem", "member.key", "member.csr", "member.pem"))
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
        "-subj", "/CN=memcache test CA", "-keyout", ca_key, "-out", ca)
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-subj", "/CN=memcache member", "-keyout", key, "-out", csr)
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2", "-out", cert)
    return {"tls_enable": True, "tls_ca_path": ca, "tls_cert_path": cert, "tls_key_path": key}


def terminate(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Send ``sig`` to a live ``proc`` and reap it; SIGKILL when it has not exited in ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


PR_SET_PDEATHSIG = 1   # linux/prctl.h


@functools.cache
def _prctl() -> Any:
    """libc's ``prctl``, looked up in the parent: the child between fork and exec only calls it."""
    return ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent() -> Callable[[], None] | None:
    """The ``preexec_fn`` for ``subprocess.Popen`` of a server a test starts: on Linux the child is
    sent SIGKILL when the process that started it dies (a pytest killed by a CI timeout, Ctrl-C or
    ``kill -9``), instead of living on with PPID 1, holding its ports and shared memory into the next
    run. A parent that died before the child's ``prctl`` took effect is caught by the child (its
    parent is no longer the starter): it kills itself.

    The kernel sends the signal when the *thread* that started the child exits, so a child started
    from any thread but the main one (which lives as long as the process) is not tied: ``None``, as
    on other systems."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl, parent = _prctl(), os.getpid()

    def tie() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:   # the starter died before the tie: its signal will never come
            os.kill(os.getpid(), signal.SIGKILL)

    return tie


def free_port() -> int:
    """A loopback port free now, for a server to bind later: chosen outside the kernel's ephemeral
    range, so that no outgoing connection (which takes its local port from that range) can take it
    in between (the ``Address already in use`` of an occasional test run), and never handed out
    twice by this process."""
    lo, hi = _ephemeral_range()
    span = range(10_000, lo) if lo > 11_000 else range(hi + 1, 65_536) if hi < 64_000 else range(0)
    for _ in range(200 if span else 0):
        port = _PORT_RNG.choice(span)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:   # no room outside the ephemeral range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PORT_RNG = random.SystemRandom()   # not the seeded ``random``: two processes must not draw alike
_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32_768, 60_999


PORT_TAKEN = "the port is in use by another process"   # (errors.py: a listen that failed)


class MetaServiceProcess:
    """A MetaService in its own process, restartable on the same ports."""

    def __init__(self, config_dir: str, **overrides: Any) -> None:
        self._overrides = overrides
        self.config_path = os.path.join(config_dir, f"meta-{os.getpid()}-{id(self)}.json")
        self.log_path = self.config_path[:-5] + ".log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False
        self._pick_ports()

    def _pick_ports(self) -> None:
        """Free ports for the URLs the caller did not set, and the config file that names them."""
        urls = {key: self._overrides[key] if key in self._overrides else f"{scheme}://127.0.0.1:{free_port()}"
                for key, scheme in (("meta_service_url", "tcp"), ("config_store_url", "tcp"), ("metrics_url", "http"))}
        self.config: dict[str, Any] = {"log_level": "info", **self._overrides, **urls}
        self.meta_service_url, self.config_store_url, self.metrics_url = urls.values()
        with open(self.config_path, "w", encoding="utf-8") as f:
            json.dump(self.config, f)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def local_config(self, **overrides: Any) -> Any:
        from .config import LocalConfig
        cfg = LocalConfig(meta_service_url=self.meta_service_url, config_store_url=self.config_store_url,
                          protocol="host_shm", dram_size="64MB", client_timeout_seconds=5,
                          pool_name=self.config.get("pool_name", ""))
        for k, v in overrides.items():
            setattr(cfg, k, v)
        cfg.validate()
        return cfg

    def start(self, timeout_s: float = 30.0, _ports_left: int = 3) -> MetaServiceProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen([sys.executable, "-m", "memcache_core.meta_service",
                                      "--config_path", self.config_path],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent())
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if not self._started and PORT_TAKEN in self.log_tail(400) and _ports_left > 0:
                    # another process (another test run on this host) bound a port between free_port()
                    # and this first start: no client knows these ports yet, so take others
                    self._pick_ports()
                    return self.start(timeout_s, _ports_left - 1)
                raise RuntimeError(f"MetaService exited with {self.proc.returncode}: {self.log_tail()}")
            if self.healthy():
                self._started = True
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"MetaService not healthy within {timeout_s}s: {self.log_tail()}")

    def healthy(self) -> bool:
        """/health takes no token: probing it must not read the pool secret, which the MetaService
        creates on its first start (a fresh machine has none until then)."""
        try:
            return self.http("/health", authorized=False).get("success") is True
        except OSError:
            return False

    def admin_headers(self) -> dict[str, str]:
        """The Authorization header of the pool's admin token (none when auth is off)."""
        if self.config.get("auth_enable", True) is False:
            return {}
        from .auth import admin_token, load_secret
        secret = load_secret(self.config.get("auth_secret_path", ""), pool_name=self.config.get("pool_name", ""))
        return {"Authorization": f"Bearer {admin_token(secret)}"}

    def http(self, path: str, authorized: bool = True) -> Any:
        """GET ``path`` of the admin API. The answer may take a while: a MetaService just restarted on a
        crowded host was seen to take over 5 s (a test's poll then failed, not the MetaService); a
        test that waits for a state polls this within its own deadline."""
        url, ctx = self.metrics_url + path, None
        if self.config.get("tls_enable"):
            import ssl
            url = "https://" + url.split("://", 1)[1]
            ctx = ssl.create_default_context(cafile=self.config["tls_ca_path"])
            ctx.check_hostname = False
        req = urllib.request.Request(url, headers=self.admin_headers() if authorized else {})
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            body = r.read()
        text = path.split("?", 1)[0] in ("/metrics", "/metrics/summary", "/role", "/ha_status", "/livez")
        return body.decode() if text else json.loads(body)

    def metric(self, name: str) -> float:
        """The value of one unlabelled series of ``/metrics`` (``memcache_`` + ``name``)."""
        m = re.search(rf"^memcache_{name} (\S+)$", self.http("/metrics"), re.M)
        assert m is not None, f"memcache_{name} not in /metrics"
        return float(m.group(1))

    def rpc(self, timeout_s: float = 10.0) -> RpcClient:
        """A control-plane client with the pool's secret (the caller closes it)."""
        from .auth import load_secret
        from .rpc import RpcClient
        secret = load_secret(self.config.get("auth_secret_path", ""), pool_name=self.config.get("pool_name", ""))
        return RpcClient(self.meta_service_url, timeout_s, 0, secret)

    def segment(self, segment_id: int) -> Any:
        """A member's ``SegmentInfo`` as its peers get it (``GetSegments`` on the control plane)."""
        from . import protocol as p
        from .rpc import expect
        client = self.rpc()
        try:
            return expect(client.call(p.GetSegments([segment_id]), idempotent=True), p.Segments).segments[0]
        finally:
            client.close()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        terminate(self.proc, sig, timeout_s)
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""


def scrape_metrics(port: int, headers: dict[str, str] | None = None) -> dict[str, float]:
    """A LocalService's own metrics port (``metrics_port``), as {series: value}."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def start_local_service(config: dict[str, Any], directory: str | os.PathLike[str],
                        segments: Callable[[], list[dict[str, Any]]], name: str = "local-service",
                        env: dict[str, str] | None = None, timeout_s: float = 30.0,
                        preexec: Callable[[], None] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """``memcache local-service`` (a standalone memory provider) with ``config``, written to
    ``directory/name.json``, its output in ``name.log`` beside it. Returns the process and its
    segment id once ``segments()`` (the MetaService's /get_all_segments) lists its pid; a process that
    exits first fails the wait with its log's tail, one that never joins is killed. ``preexec`` runs
    in the child before it executes, after it is tied to this process."""
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    log_path = os.path.join(directory, f"{name}.log")
    with open(log_path, "wb") as log:
        tie = die_with_parent()

        def before_exec() -> None:
            if tie is not None:
                tie()
            if preexec is not None:
                preexec()

        proc = subprocess.Popen([sys.executable, "-m", "memcache_core.cli", "local-service", "--config_path", path],
                                stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=before_exec)

    def joined() -> int:
        ids = [s["segment_id"] for s in segments() if s.get("pid") == proc.pid]
        if not ids and proc.poll() is not None:
            with open(log_path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise AssertionError(f"{name} exited with {proc.returncode} before joining: {tail}")
        return ids[0] if ids else 0

    try:
        return proc, wait_for(joined, timeout_s, f"{name} to join the pool")
    except BaseException:
        terminate(proc, signal.SIGKILL)
        raise


@contextlib.contextmanager
def running_meta_service(**overrides: Any) -> Iterator[MetaServiceProcess]:
    """A started MetaService with the given MetaConfig overrides; terminated on exit."""
    with tempfile.TemporaryDirectory(prefix="memcache-test-") as d:
        ms = MetaServiceProcess(d, **overrides)
        try:
            yield ms.start()
        finally:
            ms.stop()
