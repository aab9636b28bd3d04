"""A LocalService's data server serves requests for its own segment only (``transfer/tcp_server.py``):
it learns the segment id when the LocalService joins; a request naming any other is refused."""

from __future__ import annotations

import numpy as np
import pytest

from memcache_core import LocalConfig
from memcache_core.errors import PeerUnavailable
from memcache_core.local.service import LocalService
from memcache_core.transfer.tcp import TcpClient
from tests.loops import DATA_SERVER_LOOPS


@pytest.mark.parametrize("loop", DATA_SERVER_LOOPS)
def test_a_joined_data_server_refuses_requests_for_another_segment(meta, loop):
    """Scenario: a provider joined as segment S; a reader whose table lists another segment at its
    address (a dead provider's) is refused, nothing read; the reader of S gets the bytes."""
    cfg = LocalConfig(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url,
                      protocol="host_tcp", dram_size="8MB", client_timeout_seconds=5, data_server_loop=loop)
    svc = LocalService(cfg)
    svc.start(0, with_segment=True)
    client = TcpClient(5.0, svc.secret, svc.tls_client)
    try:
        assert svc.segment is not None and svc.data_server is not None
        sid, addr = svc.client_id, svc.data_server.addr
        svc.segment.view(4096, 4096)[:] = b"\x5a" * 4096
        out = np.zeros(4096, np.uint8)
        with pytest.raises(PeerUnavailable, match="does not serve segment"):
            client.read(addr, [(4096, [(out.ctypes.data, out.nbytes)])], segment_id=sid ^ 1)
        assert not out.any()
        client.read(addr, [(4096, [(out.ctypes.data, out.nbytes)])], segment_id=sid)
        assert out.tobytes() == b"\x5a" * 4096
    finally:
        client.close()
        svc.close()
