"""What names an object or a segment names that one only, whoever holds the pool secret: a data
server serves the segment it joined as and no other id (none is a wildcard), and a GVA names the same
object in every process of the pool."""

from __future__ import annotations

import numpy as np
import pytest

from memcache_core import G2H
from memcache_core.errors import INVALID_PARAM, PeerUnavailable
from memcache_core.testing import MetaServiceProcess
from memcache_core.transfer.tcp import TcpClient
from tests.integration.store_worker import digest, pattern
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
    (seg,) = meta.http("/api/v1/segments")["segments"]
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


def test_a_gva_names_one_object_in_every_process_of_the_pool(meta: MetaServiceProcess, stores):
    """Scenario: two providers each hold one object at the same offset of their own segments; client A
    describes the first (``batch_get_key_info``), client B the second. Before, each client numbered the
    segments it met from 1, so A's GVA and B's were the same 64-bit value: passed from A to B (as an
    engine passes GVAs between its workers), it read B's object with rc 0. Now a GVA's segment number
    is the pool's (issued by the MetaService): the two differ; A's GVA in B is refused until B describes
    that object too, and then reads that object's bytes, never the other's."""
    size = 64 << 10
    p1, p2 = stores(), stores()
    assert p1("put", keys=["x"], layout=[size])["codes"] == [0]
    assert p2("put", keys=["y"], layout=[size])["codes"] == [0]
    where = {k: meta.http(f"/query_key?key={k}")["locations"][0] for k in ("x", "y")}
    assert where["x"]["segment"] != where["y"]["segment"]
    assert where["x"]["offset"] == where["y"]["offset"], where   # the case where the two GVAs collided
    a, b = stores(init_bm=False), stores(init_bm=False)
    (gx,), (gy,) = a("gva_info", keys=["x"])["gvas"][0], b("gva_info", keys=["y"])["gvas"][0]
    assert gx != gy, "two processes' GVAs of two objects are the same value"
    assert b("call", method="batch_add_lease", args=[["y"], 60_000])["result"] == [0]
    got = b("gva_copy", gvas=[gx], size=size, direct=G2H)
    assert got["code"] != 0 or got["digest"] == digest(pattern("x", size)), "A's GVA read another object in B"
    assert got["code"] == INVALID_PARAM, got   # B was told nothing of x: the GVA names nothing it knows
    assert b("gva_info", keys=["x", "y"])["gvas"] == [[gx], [gy]], "a GVA differs between processes"
    assert b("call", method="batch_add_lease", args=[["x"], 60_000])["result"] == [0]
    assert b("gva_copy", gvas=[gx], size=size, direct=G2H)["digest"] == digest(pattern("x", size))
    assert b("gva_copy", gvas=[gy], size=size, direct=G2H)["digest"] == digest(pattern("y", size))
