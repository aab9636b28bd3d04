"""``memcache status``, ``status --watch``, ``keys --prefix`` and ``remove --prefix``: the real CLI as a
subprocess against a real MetaService with a LocalService holding objects."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from memcache_core import DistributedObjectStore
from memcache_core.auth import admin_token, load_secret
from memcache_core.testing import MetaServiceProcess, wait_for

pytestmark = pytest.mark.integration
ENV = {**os.environ, "COLUMNS": "220"}


def cli(*args: str, columns: int = 220) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memcache_core.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**ENV, "COLUMNS": str(columns)})


@pytest.fixture
def pool(meta):
    s = DistributedObjectStore()
    assert s.setup(meta.local_config()) == 0 and s.init(0, True) == 0
    for i in range(5):
        assert s.put(f"ns-a@{i}", b"a" * 5000) == 0 and s.put(f"ns-b@{i}", b"b" * 5000) == 0
    yield meta, s
    s.close()


def test_status_prints_members_segments_and_usage(pool):
    meta, s = pool
    out = cli("status", "--url", meta.metrics_url)
    assert out.returncode == 0, out.stderr
    sid = str(s.get_local_service_id())
    assert "segments" in out.stdout and "members" in out.stdout and sid in out.stdout
    assert "objects 10" in out.stdout and "members 1" in out.stdout, out.stdout
    token = admin_token(load_secret(""))
    assert cli("status", "--url", meta.metrics_url, "--token", token).returncode == 0
    bad = cli("status", "--url", meta.metrics_url, "--token", "wrong")
    assert bad.returncode != 0 and "HTTP 401" in bad.stderr
    down = cli("status", "--url", "http://127.0.0.1:9")
    assert down.returncode != 0 and "cannot reach the MetaService" in down.stderr


def test_status_at_80_columns_keeps_every_id_whole(pool):
    """Scenario: an operator copies a segment id from `memcache status` in an 80-column terminal into
    `memcache drain`: the ids are printed whole and no line is wider than the terminal."""
    meta, s = pool
    client = DistributedObjectStore()     # a pure client: a member without a segment
    assert client.setup(meta.local_config()) == 0 and client.init(0, False) == 0
    try:
        out = cli("status", "--url", meta.metrics_url, columns=80)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert max(len(line) for line in lines) <= 80, out.stdout
        sid = str(s.get_local_service_id())
        assert sum(sid in line.split() for line in lines) == 2, out.stdout   # the segment's row and its member's
        assert any(str(client.get_local_service_id()) in line.split() for line in lines), out.stdout
        assert "objects 10" in out.stdout and "hit ratio" in out.stdout
    finally:
        client.close()


def test_status_json_is_the_snapshot(pool):
    meta, s = pool
    out = cli("status", "--url", meta.metrics_url, "--json")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["objects"] == 10 and [g["segment_id"] for g in snap["segments"]] == [s.get_local_service_id()]
    assert [m["client_id"] for m in snap["members"]] == [s.get_local_service_id()]


def test_token_prints_the_admin_token_and_a_missing_secret_says_what_to_do(pool, tmp_path):
    meta, _ = pool
    out = cli("token")
    assert out.returncode == 0 and out.stdout.strip() == admin_token(load_secret("")), out.stderr
    assert cli("status", "--url", meta.metrics_url, "--token", out.stdout.strip()).returncode == 0
    missing = str(tmp_path / "nowhere.secret")
    for args in (("token", "--secret-path", missing), ("status", "--url", meta.metrics_url, "--secret-path", missing)):
        bad = cli(*args)
        assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr
        assert f"cannot read the pool secret {missing}" in bad.stderr and "--secret-path" in bad.stderr, bad.stderr
        assert "$MEMCACHE_ADMIN_TOKEN" in bad.stderr


def test_status_watch_redraws_until_interrupted(pool):
    meta, _ = pool
    p = subprocess.Popen([sys.executable, "-m", "memcache_core.cli", "status", "--watch", "--interval", "0.2",
                          "--url", meta.metrics_url], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        seen = []
        assert p.stdout is not None

        def two_frames() -> bool:
            seen.append(p.stdout.readline())   # type: ignore[union-attr]
            return sum("objects 10" in line for line in seen) >= 2
        wait_for(two_frames, 20, "two redraws of memcache status --watch")
        p.send_signal(signal.SIGINT)
        # keep reading (through the same text stream) while it exits: with the pipe full it would block
        threading.Thread(target=p.stdout.read, daemon=True).start()
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_keys_and_remove_by_prefix(pool):
    meta, s = pool
    out = cli("keys", "--url", meta.metrics_url, "--prefix", "ns-a@")
    assert out.returncode == 0 and out.stdout.split() == [f"ns-a@{i}" for i in range(5)], out
    assert len(cli("keys", "--url", meta.metrics_url).stdout.split()) == 10
    out = cli("remove", "--url", meta.metrics_url, "--prefix", "ns-a@")
    assert out.returncode == 0 and "removed 5 objects" in out.stdout, out
    assert s.is_exist("ns-a@0") == 0 and s.is_exist("ns-b@0") == 1
    assert cli("keys", "--url", meta.metrics_url, "--prefix", "ns-a@").stdout.split() == []
    empty = cli("remove", "--url", meta.metrics_url, "--prefix", "")
    assert empty.returncode != 0 and "prefix" in empty.stderr


def test_drain_moves_a_segment_with_a_progress_bar(meta):
    """`memcache drain SEGMENT`: provider A's objects move to B while the CLI follows the drain; it
    exits 0 when all moved, every object reads back byte-exact from B, and an unknown segment is a
    clear error."""
    a, b = DistributedObjectStore(), DistributedObjectStore()
    for s in (a, b):
        assert s.setup(meta.local_config(heartbeat_interval_ms=200)) == 0 and s.init(0, True) == 0
    try:
        a_id = a.get_local_service_id()
        keys = [f"d@{i}" for i in range(12)]
        for k in keys:
            assert a.put(k, k.encode() * 1000) == 0
        done = cli("drain", str(a_id), "--url", meta.metrics_url, "--timeout-ms", "20000")
        assert done.returncode == 0, done.stderr + done.stdout
        assert f"segment {a_id}: done, 12 objects" in done.stdout and "0 dropped" in done.stdout
        assert all(b.get(k) == k.encode() * 1000 for k in keys)
        assert all(loc["segment"] != a_id for k in keys for loc in meta.http(f"/query_key?key={k}")["locations"])
        unknown = cli("drain", "987654", "--url", meta.metrics_url)
        assert unknown.returncode != 0 and "segment 987654 not found" in unknown.stderr
    finally:
        a.close()
        b.close()


def _secret_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def test_a_refused_token_names_the_secret_file_and_pool_name(tmp_path):
    """Scenario: a host holds the secrets of an unnamed pool and of the pool named ``blue``, whose
    MetaService runs. ``memcache status`` without ``--pool-name`` sends the unnamed pool's token: the
    401 names the secret file it used and ``--pool-name`` (and ``blue``); with ``--pool-name blue``
    it works. ``memcache token`` without ``--pool-name`` prints the unnamed pool's token with a
    warning that names ``blue``; with it, no warning."""
    home = tmp_path / "home"
    unnamed = _secret_file(home / ".config" / "memcache" / "pool.secret")
    blue = _secret_file(home / ".config" / "memcache" / "pool-blue.secret")
    env = {k: v for k, v in ENV.items() if k not in ("MEMCACHE_SECRET_PATH", "MEMCACHE_POOL_NAME")}
    env["HOME"] = str(home)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "memcache_core.cli", *args], capture_output=True, text=True,
                              timeout=60, env=env)
    ms = MetaServiceProcess(str(tmp_path), pool_name="blue", auth_secret_path=str(blue))
    try:
        ms.start()
        bad = run("status", "--url", ms.metrics_url, "--json")
        assert bad.returncode != 0 and "HTTP 401" in bad.stderr, bad.stderr
        assert str(unnamed) in bad.stderr and "--pool-name" in bad.stderr and "blue" in bad.stderr, bad.stderr
        good = run("status", "--url", ms.metrics_url, "--json", "--pool-name", "blue")
        assert good.returncode == 0, good.stderr
    finally:
        ms.stop()
    default = run("token")
    assert default.returncode == 0 and default.stdout.strip() == admin_token(load_secret(str(unnamed)))
    assert "warning" in default.stderr and "--pool-name" in default.stderr and "blue" in default.stderr, default.stderr
    named = run("token", "--pool-name", "blue")
    assert named.returncode == 0 and named.stdout.strip() == admin_token(load_secret(str(blue)))
    assert named.stderr == ""
