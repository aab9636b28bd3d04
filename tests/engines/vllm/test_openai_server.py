"""``vllm serve`` (the OpenAI server) with ``--kv-transfer-config``, run through the example
``examples/vllm/serve_with_memcache.py`` (which also starts the pool)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import requests
from vllm_harness import BLOCK, MAX_TOKENS, P1, P2, REPO, engine_env

from memcache_core.testing import die_with_parent, free_port, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLE = REPO / "examples" / "vllm" / "serve_with_memcache.py"


def complete(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    r = requests.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "logprobs": 1, "return_tokens_as_token_ids": True, "ignore_eos": True})
    r.raise_for_status()
    return r.json()


def test_openai_server_reports_pool_hits(tiny_model: str, baseline, tmp_path: Path) -> None:
    """Scenario: a server with the connector (local prefix cache off) answers P1, saving its
    blocks to the pool; P2 (P1 + 150 tokens) then reports P1's blocks in
    usage.prompt_tokens_details.cached_tokens, with the baseline's tokens and logprobs."""
    port = free_port()
    log = tmp_path / "server.log"
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--model", tiny_model, "--port", str(port),
         "--block-size", str(BLOCK), "--pool-dram", "256MB", "--", "--dtype", "bfloat16",
         "--max-model-len", "4096", "--seed", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=engine_env(),
        start_new_session=True, preexec_fn=die_with_parent())
    ready = threading.Event()
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        with open(log, "w") as f:
            for line in proc.stdout:
                f.write(line)
                lines.append(line)
                if line.startswith("READY "):
                    ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        def up() -> bool:
            if ready.wait(0.5):
                return True
            assert proc.poll() is None, "".join(lines[-60:])
            return False

        wait_for(up, 400, lambda: "the server to get ready:\n" + "".join(lines[-60:]), interval_s=0)
        url = f"http://127.0.0.1:{port}"
        first = complete(url, tiny_model, P1)
        second = complete(url, tiny_model, P2)
        metrics = requests.get(f"{url}/metrics", timeout=30).text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P1) // BLOCK * BLOCK
    for name, resp in (("P1", first), ("P2", second)):
        lp = resp["choices"][0]["logprobs"]
        got = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        assert got == baseline[name]["token_ids"], name
        assert lp["token_logprobs"] == pytest.approx(baseline[name]["logprobs"], abs=1e-6), name
    hits = [ln for ln in metrics.splitlines() if ln.startswith("vllm:external_prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) == len(P1) // BLOCK * BLOCK
    assert any(ln.startswith("vllm:memcache_load_blocks_total") for ln in metrics.splitlines())
