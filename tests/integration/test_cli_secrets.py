"""``memcache secrets`` and ``memcache forget-pool``: the real CLI, under a home of its own, against a
real MetaService that made its pool's secret file itself."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from memcache_core.testing import die_with_parent, free_port, terminate, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def run(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MEMCACHE_SECRET_PATH", "MEMCACHE_POOL_NAME")}
    return subprocess.run([sys.executable, "-m", "memcache_core.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**env, "HOME": str(home)})


def _secret(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def test_a_pools_secret_is_listed_and_forgotten_only_once_its_metaservice_is_gone(home, tmp_path):
    """Scenario: a MetaService named ``green`` makes its secret file. ``memcache secrets`` lists it
    beside the others; ``forget-pool`` refuses while that MetaService answers at the pool file's
    address, removes another pool's file there (the MetaService refuses that secret: not its pool),
    refuses a name without a file and an etcd address, and removes ``green``'s once it stopped."""
    folder = home / ".config" / "memcache"
    _secret(folder / "pool.secret")
    red = _secret(folder / "pool-red.secret")
    pool = {"meta_service_url": f"tcp://127.0.0.1:{free_port()}", "config_store_url": f"tcp://127.0.0.1:{free_port()}",
            "metrics_url": f"http://127.0.0.1:{free_port()}", "pool_name": "green", "protocol": "host_shm"}
    conf = tmp_path / "pool.json"
    conf.write_text(json.dumps(pool))
    env = {k: v for k, v in os.environ.items() if k != "MEMCACHE_SECRET_PATH"}
    log = tmp_path / "meta.log"
    with open(log, "wb") as out:
        meta = subprocess.Popen([sys.executable, "-m", "memcache_core.cli", "meta-service", "--config_path", str(conf)],
                                stdout=out, stderr=subprocess.STDOUT, env={**env, "HOME": str(home)},
                                preexec_fn=die_with_parent())
    green = folder / "pool-green.secret"
    try:
        def up() -> bool:
            assert meta.poll() is None, log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(pool["metrics_url"] + "/health", timeout=5) as r:
                    return r.status == 200
            except OSError:
                return False
        wait_for(up, 30, "the MetaService")
        assert green.exists()

        listed = run(home, "secrets")
        assert listed.returncode == 0, listed.stderr
        rows = [line.split() for line in listed.stdout.splitlines()]
        assert rows[0][:2] == ["pool", "modified"]
        assert [(r[0], r[-1]) for r in rows[1:]] == [("(no", str(folder / "pool.secret")),
                                                     ("green", str(green)), ("red", str(red))], listed.stdout

        busy = run(home, "forget-pool", "--config_path", str(conf))
        assert busy.returncode == 1 and green.exists(), busy.stderr
        assert "a MetaService of this pool answers there" in busy.stderr and str(green) in busy.stderr, busy.stderr
        assert "Traceback" not in busy.stderr
        busy = run(home, "forget-pool", "--pool-name", "green", "--meta-service-url",
                   f"tcp://127.0.0.1:{free_port()},{pool['meta_service_url']}")
        assert busy.returncode == 1 and green.exists() and pool["meta_service_url"] in busy.stderr, busy.stderr

        # green's MetaService refuses red's secret: it is not red's pool
        other = run(home, "forget-pool", "--pool-name", "red", "--meta-service-url", pool["meta_service_url"])
        assert other.returncode == 0 and not red.exists(), other.stderr
        assert "can no longer be read" in other.stdout

        # something that says nothing (an HTTP port) could be the pool's MetaService: refused
        quiet = run(home, "forget-pool", "--pool-name", "green", "--meta-service-url",
                    "tcp://" + pool["metrics_url"].split("://")[1])
        assert quiet.returncode == 1 and green.exists() and "could be this pool's MetaService" in quiet.stderr, quiet.stderr

        missing = run(home, "forget-pool", "--pool-name", "blue")
        assert missing.returncode == 1 and "no secret file of the pool 'blue'" in missing.stderr
        etcd = run(home, "forget-pool", "--pool-name", "green", "--meta-service-url", "etcd://127.0.0.1:2379/green")
        assert etcd.returncode == 1 and "tcp:// addresses" in etcd.stderr and green.exists()
    finally:
        terminate(meta)

    gone = run(home, "forget-pool", "--config_path", str(conf))
    assert gone.returncode == 0 and not green.exists(), gone.stderr
    assert str(green) in gone.stdout
    left = run(home, "secrets")
    assert "green" not in left.stdout and "red" not in left.stdout and "pool.secret" in left.stdout


def test_secrets_with_none_and_with_the_variable_set(home):
    out = run(home, "secrets")
    assert out.returncode == 0 and f"no pool secret files in {home / '.config' / 'memcache'}" in out.stdout
    env = {**os.environ, "HOME": str(home), "MEMCACHE_SECRET_PATH": "/somewhere/pool.secret"}
    noted = subprocess.run([sys.executable, "-m", "memcache_core.cli", "secrets"], capture_output=True, text=True,
                           timeout=60, env=env)
    assert noted.returncode == 0 and "$MEMCACHE_SECRET_PATH is set (/somewhere/pool.secret)" in noted.stderr


def test_token_without_a_pool_name_warns_of_the_named_pools_and_points_to_memcache_secrets(home):
    """Scenario: this host holds the unnamed pool's secret and the pool ``blue``'s; the operator runs
    `memcache token` without --pool-name. It prints the unnamed pool's token (stdout stays the token
    alone) and warns, naming ``blue`` and the command that lists the secrets; with --pool-name, no
    warning; with no named pool, none either."""
    folder = home / ".config" / "memcache"
    _secret(folder / "pool.secret")
    out = run(home, "token")
    assert out.returncode == 0 and out.stderr == "" and len(out.stdout.strip()) == 64, out
    _secret(folder / "pool-blue.secret")
    out = run(home, "token")
    assert out.returncode == 0 and len(out.stdout.strip()) == 64, out
    assert "pools named blue" in out.stderr and "`memcache secrets` lists them" in out.stderr, out.stderr
    named = run(home, "token", "--pool-name", "blue")
    assert named.returncode == 0 and named.stderr == "" and named.stdout != out.stdout, named
