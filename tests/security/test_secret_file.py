"""The pool secret file (auth_secret_path): a MetaService and a LocalService refuse to start with a
secret another user could read, change or have planted, or one too weak to be a key, and say how to
make a good one."""

from __future__ import annotations

import base64
import os
import secrets
from pathlib import Path

import pytest

from memcache_core import DistributedObjectStore, errors
from memcache_core.testing import MetaServiceProcess, running_meta_service

pytestmark = pytest.mark.integration

GOOD = secrets.token_hex(32)


def _write(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text + "\n", encoding="ascii")
    os.chmod(path, mode)
    return str(path)


def _refused(tmp_path: Path, secret_path: str) -> str:
    """Start a MetaService on ``secret_path``: it must exit; its log."""
    ms = MetaServiceProcess(str(tmp_path), auth_secret_path=secret_path)
    with pytest.raises(RuntimeError, match="exited") as e:
        ms.start()
    ms.stop()
    return str(e.value)


@pytest.mark.parametrize("case", ["short", "repeated", "world-readable", "group-writable", "symlink",
                                  "foreign-owned"])
def test_a_weak_or_exposed_secret_file_is_refused_at_start(tmp_path, case):
    """Scenario: before, a 16-character repeated secret was accepted, a world-readable file only
    warned, symlinks were followed and the owner was not checked. Each is now refused by the
    MetaService at start, the message naming auth_secret_path and the remedy."""
    path = tmp_path / "pool.secret"
    if case == "short":
        target = _write(path, secrets.token_hex(12))      # 12 random bytes' worth, 24 characters
        want = "random bytes' worth"
    elif case == "repeated":
        target = _write(path, "0123456789abcdef" * 4)    # 64 characters, 8 bytes' worth
        want = "random bytes' worth"
    elif case == "world-readable":
        target = _write(path, GOOD, 0o644)
        want = "can be read or changed by other users"
    elif case == "group-writable":
        target = _write(path, GOOD, 0o660)
        want = "can be read or changed by other users"
    elif case == "symlink":   # a link of another user's, to a good file of ours
        if os.geteuid() != 0:
            pytest.skip("giving a link to another user needs root")
        _write(path, GOOD)
        target = str(tmp_path / "link.secret")
        os.symlink(path, target)
        os.lchown(target, 54321, 54321)
        want = "symbolic link another user could have made"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        target = _write(path, GOOD)
        os.chown(target, 54321, 54321)
        want = "owned by uid 54321"
    log = _refused(tmp_path, target)
    assert "auth_secret_path" in log and want in log, log
    if "worth" in want:
        assert "head -c 32 /dev/urandom | base64" in log


def test_good_secret_files_are_accepted_by_the_pool(tmp_path):
    """The remedies the refusals name work: a base64 secret from 32 random bytes (mode 0600), and a hex
    one laid out as a Kubernetes Secret volume (mode 0440 with this process's group, reached through
    the volume's own links ``pool.secret -> ..data/pool.secret``, ``..data -> ..<timestamp>``) run a
    pool that stores."""
    (tmp_path / "..2026_12_02").mkdir()
    _write(tmp_path / "..2026_12_02" / "pool.secret", GOOD, 0o440)
    os.chown(tmp_path / "..2026_12_02" / "pool.secret", -1, os.getegid())
    os.symlink("..2026_12_02", tmp_path / "..data")
    os.symlink("..data/pool.secret", tmp_path / "pool.secret")
    for path in (_write(tmp_path / "b64.secret", base64.b64encode(os.urandom(32)).decode()),
                 str(tmp_path / "pool.secret")):
        with running_meta_service(auth_secret_path=path) as meta:
            store = DistributedObjectStore()
            assert store.setup(meta.local_config(auth_secret_path=path)) == 0
            assert store.init(0, True) == 0
            try:
                assert store.put("k", b"v" * 64) == 0
                assert store.get("k") == b"v" * 64
            finally:
                store.close()


def test_two_pools_of_one_user_on_one_host_get_their_own_default_secret(tmp_path, monkeypatch):
    """Scenario: before, every pool of a user defaulted to ~/.config/memcache/pool.secret, so two pools on
    one host authenticated each other's members. A pool with a ``pool_name`` gets its own default file
    (pool-<name>.secret, created by its MetaService): a member of pool B cannot join pool A; pool A's
    members join with no secret configured; an explicit auth_secret_path still wins; a pool without a
    name keeps the old default file; a malformed name is refused naming the setting."""
    monkeypatch.setenv("HOME", str(tmp_path))   # the MetaServices (children) and the stores read it
    monkeypatch.delenv("MEMCACHE_SECRET_PATH", raising=False)
    conf = tmp_path / ".config" / "memcache"
    with running_meta_service(pool_name="a") as pool_a, running_meta_service(pool_name="b"):
        a, b = (conf / "pool-a.secret").read_bytes(), (conf / "pool-b.secret").read_bytes()
        assert a != b and not (conf / "pool.secret").exists()
        member_a = DistributedObjectStore()
        assert member_a.setup(pool_a.local_config()) == 0 and member_a.init(0, True) == 0
        member_b = DistributedObjectStore()
        explicit = DistributedObjectStore()
        try:
            assert member_a.put("k", b"v" * 64) == 0 and member_a.get("k") == b"v" * 64
            assert member_b.setup(pool_a.local_config(pool_name="b")) == 0
            assert member_b.init(0, True) == errors.META_NOT_CONNECTED   # pool B's secret: refused by pool A
            assert explicit.setup(pool_a.local_config(pool_name="b", auth_secret_path=str(conf / "pool-a.secret"))) == 0
            assert explicit.init(0, True) == 0 and explicit.get("k") == b"v" * 64
        finally:
            explicit.close()
            member_b.close()
            member_a.close()
    with running_meta_service():
        assert (conf / "pool.secret").exists()
    from memcache_core.config import LocalConfig
    from memcache_core.errors import ConfigError
    with pytest.raises(ConfigError, match="pool_name"):
        LocalConfig(pool_name="../other")
