"""A real MetaService on the native frame loop (``frame_loop: native``) serving real LocalServices
(the two loops answering alike byte for byte: tests/unit/test_frame_loop.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memcache_core.rpc import pump
from memcache_core.testing import free_port
from tests.security.wire import LAYOUT


@pytest.mark.skipif(pump.load() is None, reason="the native frame loop is not built")
@pytest.mark.parametrize("frame_loop", ["native"])
def test_a_meta_service_with_the_native_loop_serves_put_and_get_byte_exact(frame_loop, meta, stores):
    """A real MetaService started with ``frame_loop: native`` (it would refuse to start without the
    extension) and two real LocalServices over TCP: put, exist and get byte-exact."""
    writer, reader = stores(protocol="host_tcp"), stores(protocol="host_tcp")
    keys = [f"native-{i}" for i in range(8)]
    assert writer("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 8
    got = reader("get", keys=keys, layout=LAYOUT)
    assert got["codes"] == [0] * 8 and got["mismatches"] == []


def test_frame_loop_native_without_the_extension_stops_the_meta_service_at_start_naming_the_key(tmp_path):
    """A MetaService process in which the extension cannot be imported (as after an install without
    a C compiler): ``frame_loop: native`` exits non-zero at start, its error naming the key; ``auto``
    would serve on the Python loop (the tests parametrized over ``frame_loop`` run that loop)."""
    ports = [free_port() for _ in range(3)]
    path = tmp_path / "meta.json"
    path.write_text(json.dumps({"meta_service_url": f"tcp://127.0.0.1:{ports[0]}",
                                "config_store_url": f"tcp://127.0.0.1:{ports[1]}",
                                "metrics_url": f"http://127.0.0.1:{ports[2]}", "frame_loop": "native"}))
    unbuilt = ("import sys; sys.modules['memcache_core.rpc._frameloop'] = None  # (an import of it fails)\n"
               "from memcache_core.meta_service import main; sys.exit(main(['--config_path', sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", unbuilt, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "frame_loop: native, but the native frame loop" in out.stdout + out.stderr, out.stdout + out.stderr
