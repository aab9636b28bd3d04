"""A pool exposed to a network, a browser and other local users (issue 23): a data server out of file
descriptors, the pre-auth deadline, CSRF through the browser login, relayed frames, planted disk tiers.
Each test replays the attack against real processes."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import numpy as np
import pytest
import xxhash

from memcache_core import DistributedObjectStore
from memcache_core import protocol as p
from memcache_core.auth import HANDSHAKE_TIMEOUT_S, MAGIC, NONCE, TAG, admin_token, load_secret, recv_exact
from memcache_core.errors import ConfigError
from memcache_core.http_guard import HEADER_DEADLINE_S
from memcache_core.local import disk_record as rec
from memcache_core.local.disk import DiskStore
from memcache_core.memory import buffer_address
from memcache_core.rpc import MAX_PENDING_REPLIES, MAX_PREAUTH_PER_SOURCE, PREAUTH_TIMEOUT_S, RpcClient
from memcache_core.testing import (
    MetaServiceProcess,
    die_with_parent,
    free_port,
    make_tls_files,
    terminate,
    wait_for,
)
from memcache_core.transfer.tcp import TcpClient
from tests.integration.stores import StoreProcess
from tests.security.wire import LAYOUT, addr_of, ask, authed, frame

pytestmark = pytest.mark.integration

DATA_SERVER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from memcache_core.local.segment import create_segment
from memcache_core.transfer.tcp_server import DataServer
segment = create_segment(1 << 20)
segment.view(0, 4096)[:] = bytes(range(256)) * 16
server = DataServer(segment, "127.0.0.1", 0, bytes.fromhex(sys.argv[1]))
print(server.addr, flush=True)
sys.stdin.read()
"""


def test_a_data_server_out_of_descriptors_accepts_again_once_they_are_free():
    """Scenario: a data server limited to 128 descriptors gets 200 outside connections. Before, its
    accept loop returned on the first EMFILE and the server never accepted again, even after the
    connections left. Now it backs off and keeps accepting: once they are gone, an honest reader gets
    byte-exact data."""
    key = secrets.token_bytes(32)
    proc = subprocess.Popen([sys.executable, "-c", DATA_SERVER, key.hex()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True,
                            preexec_fn=die_with_parent())
    held: list[socket.socket] = []
    client = TcpClient(5.0, key)
    try:
        assert proc.stdout is not None
        addr = proc.stdout.readline().decode().strip()
        assert addr, "the data server did not start"
        host, port = addr.rsplit(":", 1)
        for i in range(200):   # from 4 source addresses: 50 each, under the per-address pre-auth cap
            held.append(socket.create_connection((host, int(port)), timeout=5, source_address=(f"127.0.0.{2 + i % 4}", 0)))
        # the server ran out: it has accepted what its table holds, the rest wait in the backlog
        wait_for(lambda: _open_fds(proc.pid) >= 120, 20, "the data server to fill its descriptor table")
        for s in held:
            s.close()
        held.clear()
        out = np.zeros(4096, dtype=np.uint8)
        ptr, _, _keep = buffer_address(out)

        def read() -> bool:
            try:
                client.read(addr, [(0, [(ptr, 4096)])])
            except Exception:   # noqa: BLE001 - still refused: try again until the deadline
                client.forget(addr)
                return False
            return True

        wait_for(read, 30, "the data server to serve an honest reader again")
        assert out.tobytes() == bytes(range(256)) * 16
        assert proc.poll() is None
    finally:
        for s in held:
            s.close()
        client.close()
        terminate(proc)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


ATTACK_PAGE = """<!doctype html><title>cat pictures</title>
<form id="f" method="POST" action="{target}/remove_prefix?prefix=secret"></form>
<script>document.getElementById("f").submit()</script>"""


def test_a_page_of_another_origin_cannot_make_the_operators_browser_remove_keys(meta, tmp_path):
    """Scenario: the operator opened /status in Chromium (HTTP Basic with the admin token: the browser
    caches it), then visits a page of another origin that auto-submits ``POST /remove_prefix``.
    Before, the browser sent the cached credentials and 4 keys were removed. Now Basic opens GET
    routes only: the form's POST reaches the server and is refused, the keys stay; the Bearer header
    (what the CLI sends) still removes them."""
    from tests.integration.test_status_page import chromium

    store = DistributedObjectStore()
    assert store.setup(meta.local_config()) == 0 and store.init(0, True) == 0
    attacker = ThreadingHTTPServer(("127.0.0.1", 0), _page_handler(ATTACK_PAGE.format(target=meta.metrics_url)))
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    port = free_port()
    browser = subprocess.Popen([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
                                f"--remote-debugging-port={port}", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for i in range(4):
            assert store.put(f"secret-{i}", bytes([i]) * 1000) == 0
        devtools = f"http://127.0.0.1:{port}"
        wait_for(lambda: _devtools(devtools, "/json/version"), 60, "Chromium's DevTools endpoint")
        token = admin_token(load_secret(meta.config.get("auth_secret_path", "")))
        host = meta.metrics_url.split("://", 1)[1]
        _devtools(devtools, f"/json/new?http://memcache:{token}@{host}/status", "PUT")
        wait_for(lambda: _tab(devtools, meta.metrics_url + "/status", "MemCache"), 60,
                 lambda: f"the operator's /status tab to load with the Basic login: {_devtools(devtools, '/json/list')}")
        # another origin (localhost, not 127.0.0.1): its form posts to the admin port
        _devtools(devtools, f"/json/new?http://localhost:{attacker.server_address[1]}/", "PUT")
        wait_for(lambda: _tab(devtools, meta.metrics_url + "/remove_prefix"), 60,
                 lambda: f"the attacker's form to be submitted by the browser: {_devtools(devtools, '/json/list')}")
        assert [store.is_exist(f"secret-{i}") for i in range(4)] == [1] * 4
        assert attacker.hits >= 1   # type: ignore[attr-defined]
        req = urllib.request.Request(meta.metrics_url + "/remove_prefix?prefix=secret", method="POST",
                                     headers=meta.admin_headers())
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read()) == {"success": True, "removed": 4}
    finally:
        terminate(browser)
        attacker.shutdown()
        attacker.server_close()
        store.close()


def _page_handler(page: str) -> type[BaseHTTPRequestHandler]:
    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            self.server.hits = getattr(self.server, "hits", 0) + 1  # type: ignore[attr-defined]
            body = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
            pass
    return Page


def _devtools(base: str, path: str, method: str = "GET") -> object:
    try:
        with urllib.request.urlopen(urllib.request.Request(base + path, method=method), timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return None


def _tab(base: str, url: str, title: str = "") -> bool:
    """A tab shows ``url`` (any user info in its address aside) with ``title`` in its title."""
    want = urlparse(url)
    for t in _devtools(base, "/json/list") or []:  # type: ignore[attr-defined]
        got = urlparse(t.get("url", ""))
        if (got.hostname, got.port, got.path) == (want.hostname, want.port, want.path) and title in t.get("title", ""):
            return True
    return False


class Relay:
    """A man in the middle on loopback: forwards one connection's bytes both ways between a member and
    the real server (so the pool handshake passes through it), and can inject its own bytes towards
    the server once the handshake is done."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = self.listener.getsockname()
        self.to_server: socket.socket | None = None
        self.from_server = 0            # bytes the server sent
        self.server_closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        member, _ = self.listener.accept()
        server = socket.create_connection(self.upstream, timeout=30)
        self.to_server = server
        threading.Thread(target=self._pump, args=(member, server, False), daemon=True).start()
        self._pump(server, member, True)

    def _pump(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if from_server:
                    self.from_server += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        if from_server:
            self.server_closed.set()
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def inject(self, data: bytes) -> None:
        assert self.to_server is not None
        with contextlib.suppress(OSError):
            self.to_server.sendall(data)

    def close(self) -> None:
        self.listener.close()
        if self.to_server is not None:
            self.to_server.close()


def test_a_relay_that_forwarded_the_handshake_cannot_inject_a_control_frame(meta):
    """Scenario: a relay (a rogue MetaService address, e.g. through an open etcd) forwards a member's
    connection to the real MetaService, lets the handshake pass, then sends its own ``RemoveAll`` on
    the authenticated connection. Before, the frame was executed and the victim's keys were gone.
    Now every frame carries the session's MAC, which the relay cannot make: the MetaService drops
    the connection, the keys stay, and the member's next call works on a new connection."""
    store = DistributedObjectStore()
    assert store.setup(meta.local_config()) == 0 and store.init(0, True) == 0
    relay = Relay(addr_of(meta.meta_service_url))
    victim = RpcClient(f"tcp://{relay.addr[0]}:{relay.addr[1]}", 10.0, 0, load_secret(meta.config.get("auth_secret_path", "")))
    try:
        for i in range(4):
            assert store.put(f"victim-{i}", bytes([i]) * 1000) == 0
        assert victim.call(p.Exist(["victim-0"]), idempotent=True) == p.Flags([True])   # handshake relayed
        seen = relay.from_server
        relay.inject(frame(p.RemoveAll(), rid=99) + secrets.token_bytes(TAG))   # no session key: a guess
        assert relay.server_closed.wait(10), "the MetaService kept the connection after a forged frame"
        assert relay.from_server == seen, "the MetaService answered the injected frame"
        assert [store.is_exist(f"victim-{i}") for i in range(4)] == [1] * 4
    finally:
        victim.close()
        relay.close()
        store.close()


def test_a_relay_cannot_inject_a_data_plane_request():
    """Scenario: the same relay in front of a data server: after the member's handshake it injects a
    write over the member's bytes. The request header carries no valid MAC: the data server drops the
    connection before reading a payload byte, and the bytes read back by an honest reader are intact."""
    key = secrets.token_bytes(32)
    proc = subprocess.Popen([sys.executable, "-c", DATA_SERVER.replace("(128, 128)", "(1024, 1024)"), key.hex()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                            preexec_fn=die_with_parent())
    client, honest = TcpClient(5.0, key), TcpClient(5.0, key)
    relay: Relay | None = None
    try:
        assert proc.stdout is not None
        addr = proc.stdout.readline().decode().strip()
        host, port = addr.rsplit(":", 1)
        relay = Relay((host, int(port)))
        out = np.zeros(4096, dtype=np.uint8)
        ptr, _, _keep = buffer_address(out)
        client.read(f"{relay.addr[0]}:{relay.addr[1]}", [(0, [(ptr, 4096)])])   # handshake relayed
        assert out.tobytes() == bytes(range(256)) * 16
        seen = relay.from_server
        forged = b"MCD2" + struct.pack("<BIQQQ", 2, 1, 0, 0, 4096)
        relay.inject(forged + secrets.token_bytes(TAG) + b"\xee" * 4096)
        assert relay.server_closed.wait(10), "the data server kept the connection after a forged request"
        assert relay.from_server == seen
        out[:] = 0
        honest.read(addr, [(0, [(ptr, 4096)])])
        assert out.tobytes() == bytes(range(256)) * 16
    finally:
        client.close()
        honest.close()
        if relay is not None:
            relay.close()
        terminate(proc)


def _trickle(addr: tuple[str, int], n: int) -> list[socket.socket]:
    """``n`` connections (from the honest members' own address) that will never finish the
    handshake, each opened after the previous one read its hello."""
    conns = []
    for _ in range(n):
        s = socket.create_connection(addr, timeout=5)
        assert recv_exact(s, len(MAGIC) + NONCE).startswith(MAGIC)
        conns.append(s)
    return conns


def _cut_within(held: list[socket.socket], limit_s: float) -> float:
    """Send each held connection a byte a second (each byte used to reset the server's timer) until
    the server has closed them all; the longest any lived. Fails past ``limit_s``."""
    start, open_ = time.monotonic(), list(held)
    longest = 0.0
    while open_:
        assert time.monotonic() - start < limit_s, f"{len(open_)} trickling connections still open after {limit_s} s"
        for s in list(open_):
            try:
                s.send(b"\0")
                closed = s.recv(1, socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed:
                open_.remove(s)
                longest = time.monotonic() - start
        time.sleep(0.25)   # the attacker's pace (a byte every 250 ms), not a wait for a state
    return longest


def test_connections_trickling_their_handshake_are_cut_at_the_deadline_and_capped_per_address(meta):
    """Scenario: an attacker without the secret, on the members' own address, opens 100 connections to
    the control plane, then to a data server, and sends one byte at a time so the connection is never
    idle. Before, each byte reset a 5 s idle timer: the slots were held for good and new members
    failed ``init``. Now at most 64 connections of one address may be in their handshake (a new one
    closes the oldest: an honest handshake takes milliseconds), the handshake is a deadline from the
    accept (all are cut within it), and an honest member from the same address connects meanwhile."""
    held = _trickle(addr_of(meta.meta_service_url), 100)
    try:
        honest = meta.rpc()
        try:
            assert honest.call(p.Exist(["k"]), idempotent=True) == p.Flags([False])
        finally:
            honest.close()
        longest = _cut_within(held, PREAUTH_TIMEOUT_S + 10)
        print(f"control plane: trickling connections cut after at most {longest:.1f} s")
        assert f"{MAX_PREAUTH_PER_SOURCE} connections in their handshake" in meta.log_tail(20_000)
    finally:
        for s in held:
            s.close()
    key = secrets.token_bytes(32)
    proc = subprocess.Popen([sys.executable, "-c", DATA_SERVER.replace("(128, 128)", "(1024, 1024)"), key.hex()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                            preexec_fn=die_with_parent())
    client = TcpClient(5.0, key)
    held = []
    try:
        assert proc.stdout is not None
        addr = proc.stdout.readline().decode().strip()
        host, port = addr.rsplit(":", 1)
        held = _trickle((host, int(port)), 100)
        out = np.zeros(4096, dtype=np.uint8)
        ptr, _, _keep = buffer_address(out)
        client.read(addr, [(0, [(ptr, 4096)])])
        assert out.tobytes() == bytes(range(256)) * 16
        longest = _cut_within(held, HANDSHAKE_TIMEOUT_S + 10)
        print(f"data server: trickling connections cut after at most {longest:.1f} s")
    finally:
        for s in held:
            s.close()
        client.close()
        terminate(proc)


def _plant_record(disk: str, key: str, size: int, fill: int) -> str:
    """A self-consistent record of ``key`` with no pool MAC (what another local user could write)."""
    payload = bytes([fill]) * size
    header = rec.pack_header(key, 7, size, xxhash.xxh3_64_intdigest(payload))
    path = os.path.join(disk, "objects", rec.name_of(key))
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header + payload + bytes(rec.padded(size) - size))
    return path


def test_a_disk_tier_prepared_by_another_local_user_is_refused_and_planted_records_are_misses(meta, tmp_path):
    """Scenario: another local user pre-creates ``disk_path`` under a sticky shared directory with a
    LOCK symlink to a root-owned 0600 file, and plants a self-consistent record. Before, the
    provider truncated and rewrote the file through the symlink, and an honest get returned the
    planted bytes. Now a disk_path not owned by this user (or writable by others) is refused at init,
    a LOCK symlink in one's own directory too (the target untouched), and a planted record (no MAC of
    the pool secret) is removed at the scan: a get of its key is a miss."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's own bytes\n")
    victim.chmod(0o600)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    planted = shared / "tier"
    planted.mkdir()
    planted.chmod(0o777)
    os.symlink(victim, planted / "LOCK")
    if os.getuid() == 0:
        os.chown(planted, 65534, 65534)   # another user's directory
    with pytest.raises(RuntimeError, match="-3000"):
        StoreProcess(meta, disk_path=str(planted), disk_size="64MB")
    with pytest.raises(ConfigError, match="belongs to uid|writable by other users"):
        DiskStore(str(planted), 64 << 20)
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    os.symlink(victim, own / "LOCK")
    with pytest.raises(RuntimeError, match="-3000"):
        StoreProcess(meta, disk_path=str(own), disk_size="64MB")
    with pytest.raises(ConfigError, match="symlink"):
        DiskStore(str(own), 64 << 20)
    assert victim.read_bytes() == b"root's own bytes\n" and victim.stat().st_mode & 0o777 == 0o600
    os.unlink(own / "LOCK")
    size = sum(LAYOUT)
    record = _plant_record(str(own), "planted-0", size, 0xAB)
    provider = StoreProcess(meta, disk_path=str(own), disk_size="64MB")
    reader = StoreProcess(meta)
    try:
        assert not os.path.exists(record)
        got = reader("get", keys=["planted-0"], layout=LAYOUT)
        assert got["codes"][0] != 0 and got["mismatches"] == []
        assert provider("put", keys=["honest-0"], layout=LAYOUT)["codes"] == [0]   # the tier still works
    finally:
        reader.stop()
        provider.stop()


def test_an_idle_connection_to_the_https_admin_port_does_not_freeze_health(tmp_path):
    """Scenario: with ``tls_enable`` the admin server speaks HTTPS; one connection opens and sends
    nothing. Before, the TLS handshake ran in the accept loop with no timeout: /health (the liveness
    probe) timed out while it sat there. Now the handshake runs in the connection's own thread with a
    deadline: /health answers at once, and the idle connection is closed after the deadline."""
    ms = MetaServiceProcess(str(tmp_path), **make_tls_files(str(tmp_path)))
    idle: list[socket.socket] = []
    try:
        ms.start()
        for _ in range(3):
            idle.append(socket.create_connection(addr_of(ms.metrics_url), timeout=5))
        for _ in range(5):
            assert ms.http("/health")["success"] is True   # urlopen's 5 s timeout: fails if frozen
        for s in idle:
            s.settimeout(15)
            assert s.recv(1) == b""                          # closed by the server at its deadline
    finally:
        for s in idle:
            s.close()
        ms.stop()


def test_memcache_status_prints_a_members_host_id_as_text_not_markup(meta):
    """Scenario: a member joins with the host id ``[/]x[bold red]y[/bold red]``. Before, ``memcache
    status`` crashed on it (rich's MarkupError) or rendered its markup. Now it prints it verbatim."""
    host = "[/]x[bold red]y[/bold red]"
    store = DistributedObjectStore()
    assert store.setup(meta.local_config(host_id=host, protocol="host_tcp")) == 0 and store.init(0, True) == 0
    try:
        out = subprocess.run([sys.executable, "-m", "memcache_core.cli", "status", "--url", meta.metrics_url],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "300"})
        assert out.returncode == 0, out.stderr
        assert host in out.stdout, out.stdout
    finally:
        store.close()


def test_unread_replies_of_all_connections_share_one_budget(meta):
    """Scenario: an insider stores a 1 MiB config value, then 16 connections each ask for it 63 times
    and never read (63 MiB each: under the per-connection cap). Before, the MetaService grew by about
    1 GB. Now the replies waiting for all connections together are capped at MAX_PENDING_REPLIES:
    connections over it are cut, the RSS grows by about that much at most, and an honest client is
    answered throughout."""
    first = authed(addr_of(meta.config_store_url))
    assert isinstance(ask(first, p.ConfigPut("blob", b"b" * (1 << 20))), p.Ok)
    first.close()
    before = _rss_mib(meta.pid)
    peak = before
    conns = []
    try:
        for _ in range(16):
            s = authed(addr_of(meta.config_store_url))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conns.append(s)
        for s in conns:
            with contextlib.suppress(OSError):
                s.sendall(b"".join(frame(p.ConfigGet("blob"), rid=i, s=s) for i in range(63)))
            peak = max(peak, _rss_mib(meta.pid))
        honest = authed(addr_of(meta.config_store_url))
        assert isinstance(ask(honest, p.ConfigGet("blob")), p.Value)
        honest.close()
        for _ in range(20):   # sampled over the time the server spends on the replies
            peak = max(peak, _rss_mib(meta.pid))
            time.sleep(0.05)
    finally:
        for s in conns:
            s.close()
    grew = peak - before
    print(f"MetaService RSS grew by {grew:.0f} MiB with 16 x 63 MiB of unread replies")
    assert grew < (MAX_PENDING_REPLIES >> 20) + 150


def _rss_mib(pid: int | None) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_connections_trickling_their_http_headers_do_not_keep_health_from_answering(meta):
    """Scenario: 300 connections to the admin port (from the probes' own address) each send a header
    byte now and then, never finishing. Before, each byte reset the socket timeout: 1,030 of them kept
    /health failing for as long as they lasted. Now at most 64 of one address may be sending headers
    (a new one closes the oldest), every connection must finish its headers within
    HEADER_DEADLINE_S, and /health answers throughout."""
    held = []
    try:
        for _ in range(300):
            s = socket.create_connection(addr_of(meta.metrics_url), timeout=5)
            s.sendall(b"GET /get_all_keys HTTP/1.1\r\nX: ")
            held.append(s)
        for _ in range(5):
            assert meta.http("/health", authorized=False)["success"] is True
        longest = _cut_within(held, HEADER_DEADLINE_S + 10)
        print(f"admin: trickling connections cut after at most {longest:.1f} s")
        assert meta.http("/health", authorized=False)["success"] is True
    finally:
        for s in held:
            s.close()
