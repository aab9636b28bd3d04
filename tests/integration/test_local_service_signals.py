"""``memcache local-service`` and SIGTERM while it starts: an operator (or a kubelet) that stops a
provider during its start (it may already have joined) gets a clean close and exit 0, never the
signal's default action. Real process; the MetaService it joins accepts and never answers, so the
start is provably still under way when the signal comes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from memcache_core.testing import MetaServiceProcess, die_with_parent, wait_for

pytestmark = pytest.mark.integration


def test_sigterm_while_starting_closes_cleanly(meta: MetaServiceProcess, tmp_path: Path) -> None:
    hung = socket.create_server(("127.0.0.1", 0))
    hung.settimeout(30)
    url = f"tcp://127.0.0.1:{hung.getsockname()[1]}"
    cfg = {"meta_service_url": url, "config_store_url": url, "protocol": "host_shm", "dram_size": "32MB",
           "client_timeout_seconds": 30, "pool_name": meta.config.get("pool_name", "")}
    path = tmp_path / "provider.json"
    path.write_text(json.dumps(cfg))
    log = open(tmp_path / "provider.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "memcache_core.cli", "local-service", "--config_path", str(path)],
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
    try:
        conn, _ = hung.accept()   # its start has reached the MetaService, which never answers
        try:
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: proc.poll() is not None, 20, "the provider to exit after SIGTERM")
            assert proc.returncode == 0, (tmp_path / "provider.log").read_text()
        finally:
            conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        hung.close()
