"""Host faults: a full segment directory, failed init and close, stale segment files of other pid
namespaces, departed peers' mappings, wildcard data addresses and very large re-join reports."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from memcache_core import DistributedObjectStore, LocalConfig, errors
from memcache_core import protocol as p
from memcache_core.config import ConfigError
from memcache_core.layout import footprint
from memcache_core.local import segment as segment_mod
from memcache_core.rpc import expect
from memcache_core.testing import wait_for
from tests.security.wire import LAYOUT, rpc

pytestmark = pytest.mark.integration


@pytest.fixture
def shm_dir(monkeypatch):
    """A segment directory of this test's own (under /dev/shm), so nothing else's files are touched."""
    d = tempfile.mkdtemp(prefix="memcache-sec-", dir="/dev/shm")
    monkeypatch.setenv("MEMCACHE_SHM_DIR", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_full_segment_directory_fails_init_with_a_clear_code(meta, tmp_path, monkeypatch, caplog):
    """Scenario: the segment directory is an 8 MB tmpfs (Docker's /dev/shm is 64 MB) and dram_size is
    64 MB. Before, init succeeded and a later put died of SIGBUS. Now init fails with -3001 and a
    message naming dram_size, leaves no segment file, and a segment that fits still works."""
    d = tmp_path / "tiny"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        monkeypatch.setenv("MEMCACHE_SHM_DIR", str(d))
        s = DistributedObjectStore()
        assert s.setup(meta.local_config(heartbeat_interval_ms=200, dram_size="64MB")) == 0
        with caplog.at_level(logging.ERROR, logger="memcache_core"):
            assert s.init(0, True) == errors.MALLOC_FAILED
        assert "dram_size" in caplog.text
        assert os.listdir(d) == []
        ok = DistributedObjectStore()
        assert ok.setup(meta.local_config(heartbeat_interval_ms=200, dram_size="4MB")) == 0 and ok.init(0, True) == 0
        assert ok.put("fits", b"f" * 100_000) == 0 and ok.get("fits") == b"f" * 100_000
        assert ok.close() == 0
        assert os.listdir(d) == []
    finally:
        subprocess.run(["umount", str(d)], check=False)


def test_a_failed_init_leaves_no_segment_file_and_close_stops_the_data_server(meta, shm_dir):
    """Scenario: init fails after the segment was created (no MetaService at that address): no segment
    file is left. A store that did start serves its data port until close(); after close() the port
    refuses connections and the segment file is gone."""
    bad = DistributedObjectStore()
    cfg = LocalConfig(meta_service_url="tcp://127.0.0.1:1", protocol="host_tcp", dram_size="8MB",
                      client_timeout_seconds=1)
    assert bad.setup(cfg) == 0
    assert bad.init(0, True) == errors.META_NOT_CONNECTED
    assert os.listdir(shm_dir) == []
    s = DistributedObjectStore()
    assert s.setup(meta.local_config(heartbeat_interval_ms=200, protocol="host_tcp", dram_size="8MB")) == 0 and s.init(0, True) == 0
    (seg,) = meta.http("/get_all_segments")["segments"]
    host, port = seg["data_addr"].rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=2).close()     # listening while it lives
    assert len(os.listdir(shm_dir)) == 1
    assert s.close() == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=2)
    assert os.listdir(shm_dir) == []


def test_stale_cleanup_keeps_files_locked_by_a_live_owner_of_another_pid_namespace(shm_dir, monkeypatch):
    """Scenario: two segment files named after a pid that does not exist here (as a container's
    process sharing /dev/shm looks); one is held (flock) by a live process, one by nobody. Stale
    cleanup removes only the unlocked one (before, liveness came from /proc/<pid>, and both went)."""
    held = os.path.join(shm_dir, f"memcache-4194304999-{secrets.token_hex(8)}")
    orphan = os.path.join(shm_dir, f"memcache-4194304998-{secrets.token_hex(8)}")
    for path in (held, orphan):
        with open(path, "wb") as f:
            f.truncate(1 << 16)
    assert not os.path.exists("/proc/4194304999")
    owner = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys\n"
        f"fd = os.open({held!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_SH)\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert owner.stdin and owner.stdout
    try:
        assert owner.stdout.readline().strip() == "locked"
        monkeypatch.setattr(segment_mod, "STALE_AFTER_S", 0)
        assert segment_mod.cleanup_stale_segments() == 1
        assert os.path.exists(held) and not os.path.exists(orphan)
    finally:
        owner.stdin.close()
        owner.wait(10)
    assert segment_mod.cleanup_stale_segments() == 1           # its owner is gone now: stale
    assert not os.path.exists(held)


def _mapped(path: str) -> bool:
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        return any(path in line for line in f)


def test_a_departed_peers_segment_is_unmapped_by_readers(meta, stores, monkeypatch):
    """Scenario: a reader maps a peer's segment to read from it; the peer leaves. Once the reader
    refreshes its view of the pool, the segment is no longer in its /proc/self/maps (before, readers
    kept every departed peer's segment mapped, and tmpfs usage grew with each)."""
    from memcache_core.local import membership as service_mod
    monkeypatch.setattr(service_mod, "SEGMENT_REFRESH_S", 0.3)
    peer = stores()
    assert peer("put", keys=["p"], layout=LAYOUT)["codes"] == [0]
    path = meta.segment(peer("id")["id"]).shm_path
    reader = DistributedObjectStore()
    assert reader.setup(meta.local_config(dram_size="8MB", heartbeat_interval_ms=100)) == 0
    assert reader.init(1, True) == 0
    try:
        assert len(reader.get("p")) == sum(LAYOUT)
        assert _mapped(path)
        peer.stop()
        wait_for(lambda: not _mapped(path), 10, "the departed peer's segment to be unmapped")
        assert reader.get("p") == b""
    finally:
        reader.close()


def test_wildcard_hcom_url_needs_an_advertised_address(meta, stores, caplog):
    """Scenario: ``hcom_url tcp://0.0.0.0:0`` alone is refused, naming the key (before, 0.0.0.0 was
    advertised to peers as the data address). With ``hcom_advertise_url`` it starts, peers get the
    advertised host with the bound port, and a TCP peer reads through it byte-exact."""
    with pytest.raises(ConfigError, match="hcom_url"):
        meta.local_config(heartbeat_interval_ms=200, protocol="host_tcp", hcom_url="tcp://0.0.0.0:0")
    cfg = meta.local_config(heartbeat_interval_ms=200, protocol="host_tcp")
    cfg.hcom_url = "tcp://0.0.0.0:0"
    with caplog.at_level(logging.ERROR, logger="memcache_core"):
        assert DistributedObjectStore().setup(cfg) == errors.INVALID_PARAM
    assert "hcom_url" in caplog.text
    s = DistributedObjectStore()
    assert s.setup(meta.local_config(heartbeat_interval_ms=200, protocol="host_tcp", dram_size="8MB", hcom_url="tcp://0.0.0.0:0",
                                     hcom_advertise_url="tcp://127.0.0.1:0")) == 0
    assert s.init(0, True) == 0
    try:
        host, port = meta.segment(s.get_local_service_id()).data_addr.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) != 0     # the bound port: the TCP read below goes through it
        assert s.put("adv", b"a" * 200_000) == 0
        reader = stores(protocol="host_tcp", host_id="another-host")
        got = reader("get", keys=["adv"], layout=[200_000])
        assert got["codes"] == [0]
    finally:
        s.close()


def test_a_30_mb_join_report_arrives_instead_of_timing_out(meta):
    """Scenario: a re-joining LocalService reports ~240,000 objects (a 30 MB Join frame). Before, the
    client gave the whole send 50 ms and it timed out. Now the frame arrives and gets an answer
    (Joined, or an error reply from validation) within the client timeout; the server lives on."""
    size = 1 << 16
    n = 240_000
    objs = [p.ObjectReport(f"rejoin/{i:08d}/" + "k" * 90, i * footprint(size), size, 1 + i, 0) for i in range(n)]
    seg = p.SegmentInfo(0, n * footprint(size) + (1 << 20), "h", f"/dev/shm/memcache-{os.getpid()}-{secrets.token_hex(8)}",
                        "127.0.0.1:9")
    req = p.Join(0, "h", os.getpid(), seg, objs)
    assert len(p.request_encoder.encode(req)) > 30_000_000
    c = rpc(meta)
    try:
        try:
            reply = c.call(req, timeout_s=10, probe=True)   # the client timeout: no retry
            assert isinstance(reply, p.Joined)
        except errors.InvalidParameter:
            pass
        assert expect(c.call(p.Exist(["rejoin/00000000/" + "k" * 90]), idempotent=True), p.Flags).flags[0] in (True, False)
    finally:
        c.close()
    assert meta.healthy()


def test_stale_cleanup_keeps_an_unlocked_segment_of_a_live_process_here(shm_dir, monkeypatch):
    """Scenario: a rolling upgrade on one host: a LocalService of an older build holds its segment
    without the lock. Its pid exists here, so the new build's cleanup leaves the file alone."""
    older = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    path = os.path.join(shm_dir, f"memcache-{older.pid}-{secrets.token_hex(8)}")
    with open(path, "wb") as f:
        f.truncate(1 << 16)
    try:
        monkeypatch.setattr(segment_mod, "STALE_AFTER_S", 0)
        assert segment_mod.cleanup_stale_segments() == 0 and os.path.exists(path)
    finally:
        older.stdin.close()   # type: ignore[union-attr]
        older.wait(10)
    assert segment_mod.cleanup_stale_segments() == 1 and not os.path.exists(path)
