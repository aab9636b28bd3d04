"""Servers a test starts die with the test's process: a pytest killed by a CI timeout, Ctrl-C or
``kill -9`` leaves no MetaService or LocalService running with PPID 1, holding its ports and shared
memory into the next run (``memcache_core.testing.die_with_parent``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from memcache_core.testing import wait_for

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")]

# A parent that starts its servers the way the tests do, prints their PIDs and waits to be killed.
PARENT = """
import json, sys, tempfile
from memcache_core.testing import MetaServiceProcess
from tests.integration.stores import StoreProcess
ms = MetaServiceProcess(tempfile.mkdtemp(prefix="memcache-orphan-"), log_level="warning").start()
store = StoreProcess(ms, dram_size="16MB")
print(json.dumps({"meta": ms.pid, "store": store.proc.pid}), flush=True)
sys.stdin.read()
"""


def gone(pid: int) -> bool:
    """No process ``pid`` any more: absent, or a zombie waiting for whoever adopted it to reap it."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_servers_die_when_the_process_that_started_them_is_killed():
    """Scenario: a parent process starts a MetaService (``MetaServiceProcess``) and a LocalService
    (``StoreProcess``), then is killed with SIGKILL, so no cleanup of its own runs. Both servers
    must be gone soon after (without the tie they run on with PPID 1 until someone kills them)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    pids: dict[str, int] = {}
    try:
        assert parent.stdout is not None
        pids = json.loads(parent.stdout.readline() or "{}")
        assert set(pids) == {"meta", "store"}, f"the parent did not start its servers (exit {parent.poll()})"
        assert not any(gone(pid) for pid in pids.values())
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_for(lambda: all(gone(pid) for pid in pids.values()), 20,
                 lambda: f"the servers to die with their parent: {[p for p in pids.values() if not gone(p)]} alive")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in pids.values():   # a failed run leaves nothing behind either
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
