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
    assert nixl_agent.engine_config() == "TCP_TX_SEG_SIZE=256k,TCP_RX_SEG_SIZE=256k"
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64k")
    assert nixl_agent.engine_config() == "TCP_RX_SEG_SIZE=256k"
    settings = nixl_agent.ucx_settings()
    assert settings["TCP_TX_SEG_SIZE"] == "64k" and settings["TCP_RX_SEG_SIZE"] == "256k"


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
    assert 250_000 < _tx_segment({}) <= 256 << 10
    assert 60_000 < _tx_segment({"UCX_TCP_TX_SEG_SIZE": "64k"}) <= 64 << 10
