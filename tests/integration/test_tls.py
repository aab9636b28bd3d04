"""TLS on the planes: a pool with ``tls_enable`` serves byte-exact reads over TCP, and what crosses the
network is ciphertext. A recording proxy sits between a reader and the owner's data server (the owner
advertises the proxy's address); without TLS the payload is visible in the recording (the negative
control), with TLS it is not."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading

import pytest

from memcache_core.testing import free_port, make_tls_files, running_meta_service
from tests.integration.store_worker import pattern
from tests.integration.stores import StoreProcess

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")]

LAYOUT = [64 << 10, 16 << 10]


class RecordingProxy:
    """Forwards 127.0.0.1:port to a target and keeps every byte that passes, both ways."""

    def __init__(self) -> None:
        self.port = free_port()
        self.target: tuple[str, int] | None = None
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            assert self.target is not None
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                with self._lock:
                    self.seen += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._sock.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_tcp_reads_through_a_recording_proxy(tls):
    with tempfile.TemporaryDirectory() as d:
        files = make_tls_files(d) if tls else {}
        with running_meta_service(**files) as ms:
            proxy = RecordingProxy()
            owner_port = free_port()
            owner = StoreProcess(ms, protocol="host_tcp", hcom_url=f"tcp://127.0.0.1:{owner_port}",
                                 hcom_advertise_url=f"tcp://127.0.0.1:{proxy.port}", **files)
            proxy.target = ("127.0.0.1", owner_port)
            reader = StoreProcess(ms, protocol="host_tcp", init_bm=False, **files)
            try:
                keys = [f"secret-{i}" for i in range(4)]
                assert owner("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 4
                got = reader("get", keys=keys, layout=LAYOUT)
                assert got["codes"] == [0] * 4 and got["mismatches"] == []
                assert "success" in str(ms.http("/api/v1/capacity/usage"))
                marker = pattern("secret-2", sum(LAYOUT))[1000:1064].tobytes()
                assert len(proxy.seen) > 4 * sum(LAYOUT)           # the payload went through the proxy
                assert (marker in proxy.seen) is (not tls)
            finally:
                reader.stop()
                owner.stop()
                proxy.close()


def test_a_plain_client_cannot_talk_to_a_tls_control_plane():
    from memcache_core import protocol as p
    from memcache_core.auth import load_secret
    from memcache_core.errors import MetaServiceUnavailable
    from memcache_core.rpc import RpcClient
    with tempfile.TemporaryDirectory() as d, running_meta_service(**make_tls_files(d)) as ms:
        client = RpcClient(ms.meta_service_url, 2.0, 0, load_secret(""))
        with pytest.raises(MetaServiceUnavailable):
            client.call(p.Exist(["k"]))
        client.close()
