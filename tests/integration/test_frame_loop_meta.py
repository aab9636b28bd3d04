"""A real MetaService on the native frame loop (``frame_loop: native``) serving real LocalServices
(the two loops answering alike byte for byte: tests/unit/test_frame_loop.py)."""

from __future__ import annotations

import pytest

from memcache_core.rpc import pump
from tests.security.wire import LAYOUT


@pytest.mark.parametrize("frame_loop", ["native"])
def test_a_meta_service_with_the_native_loop_serves_put_and_get_byte_exact(frame_loop, meta, stores):
    """A real MetaService started with ``frame_loop: native`` (it would refuse to start without the
    extension) and two real LocalServices over TCP: put, exist and get byte-exact."""
    if pump.load() is None:
        pytest.skip("the native frame loop is not built")
    writer, reader = stores(protocol="host_tcp"), stores(protocol="host_tcp")
    keys = [f"native-{i}" for i in range(8)]
    assert writer("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 8
    got = reader("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 8 and got["mismatches"] == []
