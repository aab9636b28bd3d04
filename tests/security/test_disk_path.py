"""The disk tier's path against another local user (local/disk_files.py): no component of ``disk_path``
may be one that user can replace, for the life of the provider.

The other user is a real one: a child process that drops to uid/gid 65534 (``nobody``) before it acts,
so the kernel's own permission checks apply to it. These tests need root to drop privileges (CI runs as
root); elsewhere they are skipped with a message.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
import traceback

import numpy as np
import pytest
import xxhash

from memcache_core.errors import ConfigError
from memcache_core.host import shm_dir
from memcache_core.layout import payload_offset
from memcache_core.local import disk_record as rec
from memcache_core.local.disk import DiskStore
from memcache_core.memory import Mapping
from memcache_core.protocol import ObjectReport
from memcache_core.testing import wait_for
from tests.integration.stores import StoreProcess

OTHER = 65534
pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root, to act as a second local user (uid 65534)")


def as_other_user(fn, *args) -> None:
    """Run ``fn(*args)`` in a child process of uid/gid ``OTHER``; raise if it failed."""
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the other user's step {fn.__name__} failed"


def sticky_dir(parent) -> str:
    """A root-owned, world-writable, sticky directory, like /tmp."""
    d = os.path.join(parent, "shared")
    os.mkdir(d)
    os.chmod(d, 0o1777)
    return d


def plant_link(link: str, target: str) -> None:
    os.symlink(target, link)


def repoint(link: str, target: str, key: str) -> None:
    """The attack's second step: re-point the link at the user's own 0777 directory, in which the
    record file the tier would write for ``key`` already waits, world-writable."""
    os.makedirs(target, exist_ok=True)
    os.chmod(target, 0o777)
    tmp = os.path.join(target, "disk", "objects", rec.name_of(key) + ".tmp")
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    for d in (os.path.join(target, "disk"), os.path.join(target, "disk", "objects"), os.path.dirname(tmp)):
        os.chmod(d, 0o777)
    with open(tmp, "wb"):
        pass
    os.chmod(tmp, 0o666)
    os.unlink(link)
    os.symlink(target, link)


@pytest.fixture
def base():
    """A root-owned 0755 directory under /tmp (pytest's own tmp_path is 0700: the other user could not
    reach into it at all)."""
    d = tempfile.mkdtemp(prefix="memcache-diskpath-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def segment():
    m = Mapping(os.path.join(shm_dir(), f"memcache-{os.getpid()}-{secrets.token_hex(4)}"), 8 << 20, create=True)
    yield m
    m.close()


def fill(m: Mapping, key: str, size: int) -> tuple[ObjectReport, bytes]:
    data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    m.array()[payload_offset(0):payload_offset(0) + size] = data
    return ObjectReport(key, 0, size, 1, xxhash.xxh3_64_intdigest(data.data)), data.tobytes()


def test_a_disk_path_through_another_users_symlink_is_refused(meta, base, segment):
    """Scenario: a second local user makes ``<sticky dir>/mc -> <sticky dir>`` before the provider (root)
    starts with ``disk_path=<sticky dir>/mc/disk``. Before, every directory above disk_path was checked
    with stat, which follows the link: init succeeded, the user then re-pointed ``mc`` at its own 0777
    directory holding the temporary record file of a key it expected, and an honest write landed in that
    file, which the user could read. Now a symlink of another user anywhere on the path is refused at
    init (the provider exits with -3000 and a message naming the link and its owner), and a symlink of
    this user's own is followed as before."""
    shared = sticky_dir(base)
    link = os.path.join(shared, "mc")
    as_other_user(plant_link, link, shared)
    assert os.lstat(link).st_uid == OTHER
    path = os.path.join(link, "disk")
    store: DiskStore | None = None
    try:
        with pytest.raises(ConfigError, match=f"{link}, on the way .*is a symlink of uid {OTHER}"):
            store = DiskStore(path, 64 << 20)
    finally:
        if store is not None:   # the attack goes on, to show what the refusal prevents
            report, _ = fill(segment, "expected-key", 100_000)
            as_other_user(repoint, link, os.path.join(shared, "evil"), "expected-key")
            store.offer([report], segment)
            wait_for(lambda: "expected-key" in store.index, 10, "the record written")
            planted = os.path.join(shared, "evil", "disk", "objects", rec.name_of("expected-key"))
            assert not os.path.exists(planted), "the honest write landed in the other user's directory"
            store.close()
    with pytest.raises(RuntimeError, match="-3000"):
        StoreProcess(meta, disk_path=path, disk_size="64MB")
    # a link of this user's own in the same sticky directory (no one else can replace it) is followed
    own = os.path.join(shared, "mine")
    os.mkdir(own, 0o700)
    os.symlink(own, os.path.join(shared, "mine-link"))
    report, data = fill(segment, "k", 100_000)
    good = DiskStore(os.path.join(shared, "mine-link", "disk"), 64 << 20)
    try:
        good.offer([report], segment)
        wait_for(lambda: "k" in good.index, 10, "the record written")
        assert os.path.exists(os.path.join(own, "disk", "objects", rec.name_of("k")))
    finally:
        good.close()


def test_the_tier_stays_in_the_directory_it_opened_whatever_is_renamed_above_it(tmp_path, segment):
    """Scenario: after the provider starts on ``<a>/disk``, ``<a>`` is renamed and a new ``<a>/disk`` made
    in its place (what an attacker who could change a component would do). Records are written, read
    and deleted relative to the directory opened at start: they stay in the moved directory, and nothing
    appears in the new one."""
    a = tmp_path / "a"
    a.mkdir(mode=0o755)
    store = DiskStore(str(a / "disk"), 64 << 20)
    try:
        os.rename(a, tmp_path / "moved")
        (a / "disk" / "objects").mkdir(parents=True, mode=0o777)
        report, data = fill(segment, "k", 100_000)
        store.offer([report], segment)
        wait_for(lambda: "k" in store.index, 10, "the record written")
        name = rec.name_of("k")
        assert (tmp_path / "moved" / "disk" / "objects" / name).exists()
        assert not (a / "disk" / "objects" / name).exists()
        buf, view = store.read("k", report.size, report.checksum)
        try:
            assert bytes(view) == data
        finally:
            view.release()
            buf.close()
        store.remove([report])
        assert not (tmp_path / "moved" / "disk" / "objects" / name).exists()
        assert stat.S_IMODE(os.stat(tmp_path / "moved" / "disk").st_mode) == 0o700
    finally:
        store.close()
