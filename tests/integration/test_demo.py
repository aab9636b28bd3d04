"""The README's first command runs ``examples/demo_pool.py`` (through ``examples/demo.sh``): the same
program here, so a change that breaks the demo fails the tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "demo_pool.py")


def test_the_demo_runs_and_every_read_is_byte_exact():
    out = subprocess.run([sys.executable, DEMO], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "demo finished: every byte read was the byte written." in out.stdout
    assert " 0 mismatched" in out.stdout and "mismatched" not in out.stdout.replace(" 0 mismatched", "")
    # it says where its `memcache` command is (its environment is not activated): a path that runs
    command = out.stdout.split("the memcache command: ", 1)[1].splitlines()[0]
    assert os.path.isabs(command.split()[0]), command
    assert subprocess.run([*command.split(), "--help"], capture_output=True, timeout=60).returncode == 0, command
