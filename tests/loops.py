"""The data server's loops a test runs on (``data_server_loop``): the C one only where it was built."""

from __future__ import annotations

import pytest

from memcache_core.transfer import dataloop

NATIVE_BUILT = dataloop.load() is not None
DATA_SERVER_LOOPS = [pytest.param("native", marks=pytest.mark.skipif(not NATIVE_BUILT, reason="the C loop is not built")),
                     "python"]


@pytest.fixture(params=DATA_SERVER_LOOPS)
def data_server_loop(request: pytest.FixtureRequest) -> str:
    """Each data-server test once per loop (tests/unit/conftest.py registers it)."""
    return str(request.param)
