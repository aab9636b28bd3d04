"""A pool exposed to a network, a browser and other local users (issue 23): a data server out of file
descriptors, the pre-auth deadline, CSRF through the browser login, relayed frames, planted disk tiers.
Each test replays the attack against real processes."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys

import numpy as np
import pytest

from memcache_core.memory import buffer_address
from memcache_core.testing import terminate, wait_for
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
