"""The pool secret file (auth_secret_path): a MetaService and a LocalService refuse to start with a
secret another user could read, change or have planted, or one too weak to be a key, and say how to
make a good one."""

from __future__ import annotations

import base64
import os
import secrets
from pathlib import Path

import pytest

from memcache_core import DistributedObjectStore
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
