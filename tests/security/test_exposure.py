"""A pool exposed to a network, a browser and other local users (issue 23): a data server out of file
descriptors, the pre-auth deadline, CSRF through the browser login, relayed frames, planted disk tiers.
Each test replays the attack against real processes."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import numpy as np
import pytest

from memcache_core import DistributedObjectStore
from memcache_core.auth import admin_token, load_secret
from memcache_core.memory import buffer_address
from memcache_core.testing import free_port, terminate, wait_for
from memcache_core.transfer.tcp import TcpClient

pytestmark = pytest.mark.integration

DATA_SERVER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from memcache_core.local.segment import create_segment
from memcache_core.transfer.tcp import DataServer
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
                            stdout=subprocess.PIPE, start_new_session=True)
    held: list[socket.socket] = []
    client = TcpClient(5.0, key)
    try:
        assert proc.stdout is not None
        addr = proc.stdout.readline().decode().strip()
        assert addr, "the data server did not start"
        host, port = addr.rsplit(":", 1)
        for _ in range(200):
            held.append(socket.create_connection((host, int(port)), timeout=5))
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
