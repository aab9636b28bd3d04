#!/usr/bin/env python3
"""Serve a model with vLLM's OpenAI server and the MemCache KV connector.

    python examples/vllm/serve_with_memcache.py --model DIR [--port 8000] [--block-size 32]
        [--meta-service-url tcp://HOST:PORT --config-store-url tcp://HOST:PORT]
        [--pool-dram 1GB] [--load-async] [-- extra vllm args]

Without ``--meta-service-url`` it first starts a pool on this host: a MetaService and a standalone
LocalService (``memcache local-service``) holding ``--pool-dram`` of shared memory, so cached
blocks outlive vLLM restarts. vLLM joins the pool as a client (``dram_size`` 0). It prints
``READY <url>`` once the server answers, and on SIGINT/SIGTERM stops everything it started.

Then e.g.:

    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "DIR", "prompt": "...", "max_tokens": 8}' | jq .usage

``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens loaded from the pool. With
``--no-enable-prefix-caching`` (the default here, to make pool hits visible) every hit is from the
pool; drop it in production and the pool serves what the local prefix cache no longer holds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from memcache_core.testing import free_port


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def start_pool(workdir: Path, dram: str) -> tuple[list[subprocess.Popen], str, str]:
    meta_url = f"tcp://127.0.0.1:{free_port()}"
    store_url = f"tcp://127.0.0.1:{free_port()}"
    metrics_url = f"http://127.0.0.1:{free_port()}"
    (workdir / "meta.json").write_text(json.dumps(
        {"meta_service_url": meta_url, "config_store_url": store_url, "metrics_url": metrics_url}))
    meta = subprocess.Popen([sys.executable, "-m", "memcache_core.cli", "meta-service",
                             "--config_path", str(workdir / "meta.json")])
    wait_http(metrics_url + "/health", meta, 30)
    (workdir / "local.json").write_text(json.dumps(
        {"meta_service_url": meta_url, "config_store_url": store_url, "protocol": "host_shm",
         "dram_size": dram}))
    local = subprocess.Popen([sys.executable, "-m", "memcache_core.cli", "local-service",
                              "--config_path", str(workdir / "local.json")])
    from memcache_core.auth import admin_token, load_secret

    # Admin routes take the pool's admin token (derived from the pool secret the MetaService uses).
    req = urllib.request.Request(metrics_url + "/get_all_segments",
                                 headers={"Authorization": f"Bearer {admin_token(load_secret(''))}"})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(req, timeout=2) as r:
            if json.load(r).get("segments"):
                break
        time.sleep(0.1)
    print(f"pool: MetaService {meta_url} (admin {metrics_url}), LocalService with {dram}", flush=True)
    return [local, meta], meta_url, store_url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--block-size", type=int, default=32, help="a multiple of 32 on CPU")
    ap.add_argument("--meta-service-url")
    ap.add_argument("--config-store-url")
    ap.add_argument("--pool-dram", default="1GB")
    ap.add_argument("--load-async", action="store_true")
    ap.add_argument("vllm_args", nargs="*", help="extra arguments for vLLM's server (after --)")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    children: list[subprocess.Popen] = []
    workdir = Path(tempfile.mkdtemp(prefix="memcache-vllm-"))
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if args.meta_service_url:
            meta_url, store_url = args.meta_service_url, args.config_store_url or "tcp://127.0.0.1:6000"
        else:
            started, meta_url, store_url = start_pool(workdir, args.pool_dram)
            children.extend(started)
        ktc = {"kv_connector": "MemCacheConnector", "kv_connector_module_path": "memcache_vllm",
               "kv_role": "kv_both",
               "kv_connector_extra_config": {"meta_service_url": meta_url, "config_store_url": store_url,
                                             "protocol": "host_shm", "dram_size": "0",
                                             "load_async": args.load_async}}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
               "--host", "127.0.0.1", "--port", str(args.port), "--block-size", str(args.block_size),
               "--enforce-eager", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
               "--kv-transfer-config", json.dumps(ktc), *args.vllm_args]
        print("vllm:", " ".join(cmd), flush=True)
        server = subprocess.Popen(cmd, start_new_session=True)
        children.insert(0, server)
        url = f"http://127.0.0.1:{args.port}"
        deadline = time.monotonic() + 600
        ready = False
        while not stop and server.poll() is None and time.monotonic() < deadline:
            try:
                wait_http(url + "/health", server, 1)
                ready = True
                break
            except TimeoutError:
                continue
        if ready:
            print(f"READY {url}", flush=True)
        while not stop and server.poll() is None:
            time.sleep(0.2)
        return 0 if stop else (server.returncode or 1)
    finally:
        for child in children:  # the server first, then the LocalService, then the MetaService
            if child.poll() is None:
                try:
                    if child is children[0] and child.pid == os.getpgid(child.pid):
                        os.killpg(child.pid, signal.SIGTERM)
                    else:
                        child.terminate()
                    child.wait(30)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    child.kill()
                    child.wait()


if __name__ == "__main__":
    sys.exit(main())
