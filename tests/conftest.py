"""Selects the Hypothesis profile for this run (``tests/hypothesis_profiles.py``): derandomized in CI.

And gives the whole run one pool secret of its own (``MEMCACHE_SECRET_PATH``, inherited by every
server a test starts), made before the first test: what a test sees must not depend on whether an
earlier test, or an earlier run on this machine, made the user's default secret file (a fresh
machine's first run failed a test that the second passed), and tests leave that file alone.
``tests/security/test_secret_file.py`` tests the default files themselves, under a home of its own.

The ``frame_loop`` fixture runs a control-plane test on the native frame loop and on the Python one."""

from __future__ import annotations

import atexit
import importlib.util
import os
import secrets
import shutil
import tempfile

import pytest

if importlib.util.find_spec("hypothesis") is not None:   # the engine environments may not have it
    from hypothesis import settings

    from tests.hypothesis_profiles import profile

    settings.load_profile(profile())

if not os.environ.get("MEMCACHE_SECRET_PATH"):   # (pytest-xdist's workers inherit the controller's)
    _home = tempfile.mkdtemp(prefix="memcache-tests-secret-")
    atexit.register(shutil.rmtree, _home, True)
    _path = os.path.join(_home, "pool.secret")
    with os.fdopen(os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="ascii") as _f:
        _f.write(secrets.token_hex(32) + "\n")
    os.environ["MEMCACHE_SECRET_PATH"] = _path


@pytest.fixture(params=["native", "python"])
def frame_loop(request: pytest.FixtureRequest) -> str:
    """The control plane's frame loop a test runs on (``frame_loop``, rpc/pump.py): each test that asks
    for it runs on both; the native one is skipped where the extension is not built."""
    from memcache_core.rpc import pump
    if request.param == "native" and pump.load() is None:
        pytest.skip("the native frame loop (memcache_core.rpc._frameloop) is not built")
    return str(request.param)
