"""The UCX defaults of the NIXL transport: ours where the environment sets nothing, the environment's
where it does (the backend's ``engine_config``; this process's environment is never written)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from memcache_core.transfer import nixl_agent
from memcache_core.transfer.nixl import available


def test_defaults_apply_where_the_environment_sets_nothing(monkeypatch):
    for key in nixl_agent.UCX_DEFAULTS:
        monkeypatch.delenv(f"UCX_{key}", raising=False)
    assert nixl_agent.engine_config() == "TCP_TX_SEG_SIZE=64k,TCP_RX_SEG_SIZE=64k"
    assert nixl_agent.ucx_settings()["TCP_TX_SEG_SIZE"] == "64k"
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "128k")   # either one set: the pair is the user's
    assert nixl_agent.engine_config() == ""
    settings = nixl_agent.ucx_settings()
    assert settings["TCP_RX_SEG_SIZE"] == "128k" and "TCP_TX_SEG_SIZE" not in settings


def _tx_segment(env: dict[str, str]) -> int:
    """The largest message UCX's tcp transport sends in one segment in an agent made by the transport
    (UCX's own protocol table, printed with UCX_PROTO_INFO)."""
    code = ("from memcache_core.transfer.nixl_agent import make_agent, own_nixl_logging\n"
            "own_nixl_logging()\nmake_agent('defaults', False)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=clean | {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_PROTO_INFO": "y"} | env)
    assert run.returncode == 0, run.stderr[-2000:]
    table = run.stderr.split("ucp_am_send*(fast-completion)", 1)[1]
    found = re.search(r"\|\s+0\.\.(\d+)\s+\|\s+short", table)
    assert found, table[:2000]
    return int(found.group(1))


@pytest.mark.skipif(not available(), reason="nixl is not installed")
def test_ucx_runs_with_our_segments_unless_the_environment_says_otherwise():
    assert 60_000 < _tx_segment({}) <= 64 << 10
    assert 120_000 < _tx_segment({"UCX_TCP_TX_SEG_SIZE": "128k", "UCX_TCP_RX_SEG_SIZE": "128k"}) <= 128 << 10
    assert _tx_segment({"UCX_TCP_RX_SEG_SIZE": "64k"}) <= 8 << 10   # UCX's own send segment


@pytest.mark.skipif(not available(), reason="nixl is not installed")
def test_settings_ucx_refuses_are_a_clear_error():
    code = ("from memcache_core.transfer.nixl_agent import make_agent, own_nixl_logging\n"
            "from memcache_core.errors import InvalidParameter\n"
            "own_nixl_logging()\n"
            "try:\n    make_agent('refused', False)\nexcept InvalidParameter as e:\n    print(e)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=clean | {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_TCP_TX_SEG_SIZE": "256k",
                                      "UCX_TCP_RX_SEG_SIZE": "8k"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "UCX refused its settings" in run.stdout and "UCX_TCP_RX_SEG_SIZE=8k" in run.stdout, run.stdout
