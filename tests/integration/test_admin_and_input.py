"""Bad input gets the right code and loses nothing; the CLI and the HTTP admin server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from memcache_core import DistributedObjectStore, LocalConfig
from memcache_core.testing import die_with_parent, wait_for

pytestmark = pytest.mark.integration


def stop_once_healthy(proc: subprocess.Popen, port: int) -> None:
    """Wait for a MetaService process to answer /health, then SIGTERM it: it must exit 0."""
    import urllib.request

    def healthy() -> bool:
        assert proc.poll() is None, f"the MetaService exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                return json.load(r)["success"] is True
        except OSError:
            return False

    try:
        wait_for(healthy, 20, "the MetaService's /health")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_input_gets_clear_codes_and_the_store_keeps_working(meta):
    s = DistributedObjectStore()
    assert s.setup(meta.local_config()) == 0 and s.init(0, True) == 0
    buf = np.arange(1 << 16, dtype=np.uint8)
    ptr = buf.ctypes.data
    assert s.register_buffer(ptr, buf.nbytes) == 0
    assert s.put_from("good", ptr, 4096) == 0
    assert s.put("k" * 300, b"x") == -3000                           # key of 300 bytes
    assert s.batch_is_exist(["k" * 300]) == [-3000]
    assert s.get_into("good", ptr, 8192) == -3000                    # larger than the object
    assert s.get_into("good", ptr, 1024) == -3000                    # smaller than the object
    assert s.put_from("neg", ptr, -5) == -3000                       # negative size
    assert s.put_from("zero", ptr, 0) == -3000
    assert s.put_from("outside", ptr + buf.nbytes - 10, 4096) == -3000   # runs past the buffer
    other = np.zeros(4096, np.uint8)
    assert s.get_into("good", other.ctypes.data, 4096) == -3000      # unregistered pointer
    assert s.put_from("wild", 0x1000, 4096) == -3000                 # never dereferenced
    assert s.batch_put_from(["a", "b"], [ptr], [1, 2]) == [-3000, -3000]   # lengths differ
    assert s.batch_put_from_layers(["a"], [[ptr, ptr]], [[16]]) == [-3000]
    assert s.batch_get_into(["good", "missing", "x" * 256], [ptr, ptr + 4096, ptr],
                            [4096, 4096, 4096]) == [0, -3007, -3000]
    assert s.is_exist("neg") == 0 and s.is_exist("wild") == 0
    assert s.register_buffer(0, 10) == -3000 and s.register_buffer(ptr, -1) == -3000
    assert s.unregister_buffer(other.ctypes.data, 4096) == -3000
    # nothing was lost and everything still works
    assert s.get_into("good", ptr + 8192, 4096) == 0
    assert np.array_equal(buf[8192:8192 + 4096], buf[:4096])
    assert s.unregister_buffer(ptr, buf.nbytes) == 0
    assert s.get_into("good", ptr, 4096) == -3000
    s.close()


@pytest.mark.parametrize("field,value", [("protocol", "carrier_pigeon"), ("dram_size", "lots"),
                                         ("meta_service_url", "nowhere"), ("world_size", 5000)])
def test_bad_local_config_names_the_key(field, value, caplog):
    s = DistributedObjectStore()
    cfg = LocalConfig(protocol="host_shm")
    setattr(cfg, field, value)
    assert s.setup(cfg) == -3000
    assert field in caplog.text
    assert s.is_exist("k") == -3008      # not initialized, not a crash


def test_ascend_protocols_say_they_need_memfabric(caplog):
    s = DistributedObjectStore()
    assert s.setup(LocalConfig(protocol="device_sdma")) == -3000
    assert "MemFabric" in caplog.text and "Ascend" in caplog.text


def test_http_admin_endpoints(meta):
    s = DistributedObjectStore()
    assert s.setup(meta.local_config()) == 0 and s.init(0, True) == 0
    assert s.put("visible", b"v" * 1000) == 0 and s.is_exist("visible") == 1 and s.get("visible")
    assert meta.http("/health")["success"] is True
    q = meta.http("/query_key?key=visible")
    assert q["success"] and q["size"] == 1000 and len(q["locations"]) == 1
    assert meta.http("/query_key?key=absent")["success"] is False
    assert meta.http("/get_all_keys")["keys"] == ["visible"]
    segs = meta.http("/get_all_segments")["segments"]
    assert len(segs) == 1 and segs[0]["capacity_bytes"] == 64 << 20 and segs[0]["objects"] == 1
    cap = meta.http("/api/v1/capacity/usage")
    # the small put went into the writer's allocation arena, reserved whole (counted as used)
    arena = meta.config.get("arena_bytes", 4 << 20)
    assert cap["total_bytes"] == 64 << 20
    assert cap["used_bytes"] == arena if arena else 0 < cap["used_bytes"] < 4096
    text = meta.http("/metrics")
    for name in ("memcache_segment_capacity_bytes", "memcache_segment_used_bytes", "memcache_objects 1",
                 "memcache_puts_total 1", "memcache_gets_total", "memcache_exists_total",
                 "memcache_evictions_total", "memcache_put_failures_total",
                 'memcache_request_seconds_count{op="exist"}', 'memcache_request_seconds_bucket{le="+Inf",op="lookup"}'):
        assert name in text, name
    s.close()


def test_cli_rejects_bad_config_and_stops_on_sigterm(tmp_path):
    from memcache_core.testing import free_port
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"evict_threshold_high": 150, "colour": "blue"}))
    out = subprocess.run([sys.executable, "-m", "memcache_core.cli", "meta-service", "--config_path", str(bad)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "evict_threshold_high" in out.stderr
    out = subprocess.run([sys.executable, "-m", "memcache_core.meta_service", "--config_path",
                          str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "missing.json" in out.stderr
    good = tmp_path / "good.json"
    port = free_port()
    good.write_text(json.dumps({"meta_service_url": f"tcp://127.0.0.1:{free_port()}",
                                "config_store_url": f"tcp://127.0.0.1:{free_port()}",
                                "metrics_url": f"http://127.0.0.1:{port}", "colour": "blue"}))
    proc = subprocess.Popen([sys.executable, "-m", "memcache_core.cli", "meta-service", "--config_path", str(good)],
                            stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent())
    stop_once_healthy(proc, port)
    assert proc.stderr is not None
    assert "colour" in proc.stderr.read()        # unknown key: a warning, not fatal


def test_env_config_path_for_meta_and_local(tmp_path, meta):
    from memcache_core.config import local_config_from_env
    path = tmp_path / "local.json"
    path.write_text(json.dumps({"meta_service_url": meta.meta_service_url, "protocol": "host_tcp",
                                "dram_size": "16MB"}))
    os.environ["MMC_LOCAL_CONFIG_PATH"] = str(path)
    try:
        assert local_config_from_env().protocol == "host_tcp"
        s = DistributedObjectStore()
        assert s.init(0, True) == 0          # setup() from MMC_LOCAL_CONFIG_PATH
        assert s.put("env", b"1") == 0 and s.get("env") == b"1"
        s.close()
    finally:
        del os.environ["MMC_LOCAL_CONFIG_PATH"]


@pytest.mark.parametrize("form", ["setup", "env"])
def test_python_form_of_the_meta_service(tmp_path, form):
    """MetaService.setup(MetaConfig); MetaService.main(), or main() alone with MMC_META_CONFIG_PATH."""
    from memcache_core.testing import free_port
    port = free_port()
    conf = {"meta_service_url": f"tcp://127.0.0.1:{free_port()}",
            "config_store_url": f"tcp://127.0.0.1:{free_port()}", "metrics_url": f"http://127.0.0.1:{port}"}
    env = dict(os.environ)
    if form == "setup":
        code = ("from memcache_core import MetaConfig, MetaService\n"
                f"assert MetaService.setup(MetaConfig(**{conf!r})) == 0\nraise SystemExit(MetaService.main())")
    else:
        path = tmp_path / "meta.json"
        path.write_text(json.dumps(conf))
        env["MMC_META_CONFIG_PATH"] = str(path)
        code = "from memcache_core import MetaService\nraise SystemExit(MetaService.main())"
    stop_once_healthy(subprocess.Popen([sys.executable, "-c", code], env=env, preexec_fn=die_with_parent()), port)
