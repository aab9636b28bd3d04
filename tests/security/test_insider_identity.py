"""What names an object or a segment names that one only, whoever holds the pool secret: a data
server serves the segment it joined as and no other id (none is a wildcard)."""

from __future__ import annotations

import numpy as np
import pytest

from memcache_core.errors import PeerUnavailable
from memcache_core.testing import MetaServiceProcess
from memcache_core.transfer.tcp import TcpClient
from tests.integration.store_worker import pattern
from tests.security.wire import secret

pytestmark = pytest.mark.integration


def test_a_data_server_serves_no_read_naming_segment_0(meta: MetaServiceProcess, stores):
    """Scenario: a provider (its own process, host_tcp) joined and holds one object. An insider with
    the secret reads the start of its segment over TCP naming segment 0: before, any data server
    served segment 0 (a wildcard past the stale-table check); now it is refused like any id the
    provider was not given (PeerUnavailable, nothing read). Naming the provider's own id reads the
    object's bytes (the control: the request itself is right)."""
    provider = stores(protocol="host_tcp", dram_size="8MB")
    size = 64 << 10
    assert provider("put", keys=["k"], layout=[size])["codes"] == [0]
    (seg,) = meta.http("/api/v1/segments/status")["segments"]
    sid, addr = seg["segment_id"], seg["data_addr"]
    want = pattern("k", size).tobytes()
    client = TcpClient(10.0, secret())
    try:
        out = np.zeros(int(seg["capacity_bytes"]), np.uint8)
        with pytest.raises(PeerUnavailable, match="does not serve segment 0"):
            client.read(addr, [(0, [(out.ctypes.data, out.nbytes)])], segment_id=0)
        assert not out.any(), "a refused read wrote into the destination"
        client.read(addr, [(0, [(out.ctypes.data, out.nbytes)])], segment_id=sid)
        assert want in out.tobytes(), "the provider's own id did not read its object"
    finally:
        client.close()
