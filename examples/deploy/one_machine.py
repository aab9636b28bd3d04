#!/usr/bin/env python3
"""The recommended deployment, on one machine: standalone providers hold the pool, engines are clients.

    python examples/deploy/one_machine.py            # the walk-through below, then stop everything
    python examples/deploy/one_machine.py --keep     # ... then keep the pool up for real engines

What it starts (configs are written to a temporary directory and printed):

* one MetaService (``memcache meta-service``);
* two providers (``memcache local-service``), each holding ``--provider-dram`` of shared memory,
  with ``drain_timeout_ms`` so that SIGTERM moves their objects to the other provider first;
* "engines": short client processes with ``dram_size`` 0 (no memory of their own), standing in for
  SGLang or vLLM servers (the lines to start real ones against this pool are printed at the end).

The walk-through: engine 1 writes KV pages and exits (a deploy); a fresh engine 2 finds every page,
byte for byte. The provider holding them is then restarted the way a rolling upgrade does it
(SIGTERM: it drains into the other, exits, and starts again empty); engine 3 still finds every page.
Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = os.path.join(HERE, "engine_client.py")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write(directory: str, name: str, config: dict[str, Any]) -> str:
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    print(f"  {name}: {json.dumps(config)}")
    return path


def memcache(role: str, config: str, log: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "memcache_core.cli", role, "--config_path", config],
                                stdout=out, stderr=subprocess.STDOUT)


def admin(metrics_url: str, path: str) -> Any:
    from memcache_core.auth import admin_token, load_secret
    req = urllib.request.Request(metrics_url + path,
                                 headers={"Authorization": f"Bearer {admin_token(load_secret(''))}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def wait(what: str, cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if cond():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def engine(cfg: str, op: str, pages: int) -> None:
    """One engine process's life: join as a client, write or read the pages, exit."""
    subprocess.run([sys.executable, ENGINE, cfg, op, str(pages)], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider-dram", default="512MB")
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--keep", action="store_true", help="keep the pool running after the walk-through")
    args = ap.parse_args()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="memcache-deploy-") as d:
        urls = {k: f"{scheme}://127.0.0.1:{free_port()}" for k, scheme in
                (("meta_service_url", "tcp"), ("config_store_url", "tcp"), ("metrics_url", "http"))}
        print(f"configs and logs in {d}:")
        # ---- MetaService -------------------------------------------------------------------------------
        # HA (etcd) goes here: once `ha_enable` is available, start three MetaServices with
        # `ha_enable: true`, `ha_etcd_endpoints` and one `ha_cluster_id`, and give every LocalService
        # below `meta_service_url: etcd://<endpoints>/<cluster_id>` instead of one MetaService's URL.
        meta_cfg = write(d, "meta.json", {**urls, "drain_timeout_ms": 60000})
        procs["meta"] = memcache("meta-service", meta_cfg, os.path.join(d, "meta.log"))
        wait("the MetaService", lambda: admin(urls["metrics_url"], "/health")["success"])
        member = {"meta_service_url": urls["meta_service_url"], "config_store_url": urls["config_store_url"],
                  "protocol": "host_shm"}
        provider = {**member, "dram_size": args.provider_dram, "hcom_url": "tcp://127.0.0.1:0",
                    "drain_timeout_ms": 30000}
        prov_cfg = write(d, "provider.json", provider)
        engine_cfg = write(d, "engine.json", {**member, "dram_size": 0, "client_timeout_seconds": 5})
        try:
            for name in ("provider-a", "provider-b"):
                procs[name] = memcache("local-service", prov_cfg, os.path.join(d, f"{name}.log"))
            wait("two providers", lambda: len(admin(urls["metrics_url"], "/get_all_segments")["segments"]) == 2)
            walk_through(procs, prov_cfg, engine_cfg, urls["metrics_url"], d, args.pages)
            if args.keep:
                print_engine_lines(urls)
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            for name, p in reversed(procs.items()):   # providers first: each drains into the others
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    p.wait(60)
                print(f"stopped {name}")
    return 0


def walk_through(procs: dict[str, subprocess.Popen[bytes]], prov_cfg: str, engine_cfg: str, metrics: str,
                 d: str, pages: int) -> None:
    print(f"\nengine 1 writes {pages} pages and exits (its memory is not part of the pool)")
    engine(engine_cfg, "write", pages)
    print("engine 2, a fresh process, reads them")
    engine(engine_cfg, "read", pages)
    fullest = max(admin(metrics, "/get_all_segments")["segments"], key=lambda s: s["objects"])
    name = next(n for n, p in procs.items() if p.pid == fullest["pid"])
    print(f"rolling restart of {name}, which holds {fullest['objects']} pages: SIGTERM drains it into the "
          f"other provider, then it starts again empty")
    procs[name].send_signal(signal.SIGTERM)
    procs[name].wait(60)
    drain = admin(metrics, f"/drain/{fullest['segment_id']}")
    print(f"  drain {drain['state']}: {drain['moved_objects']} pages ({drain['moved_bytes']} bytes) moved in "
          f"{drain['elapsed_s']} s, {drain['dropped_objects']} dropped")
    procs[name] = memcache("local-service", prov_cfg, os.path.join(d, f"{name}.log"))
    wait(f"{name} to re-join", lambda: len(admin(metrics, "/get_all_segments")["segments"]) == 2)
    print("engine 3 reads every page again")
    engine(engine_cfg, "read", pages)


def print_engine_lines(urls: dict[str, str]) -> None:
    client = {"meta_service_url": urls["meta_service_url"], "config_store_url": urls["config_store_url"],
              "protocol": "host_shm"}
    print(textwrap.dedent(f"""
        The pool is up (Ctrl-C stops it). Real engines join as clients, e.g.:
          vllm serve MODEL --kv-transfer-config '{json.dumps({
              "kv_connector": "MemCacheConnector", "kv_connector_module_path": "memcache_vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {**client, "dram_size": "0"}})}'
          python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
              --hicache-storage-backend npu_memcache \\
              --hicache-storage-backend-extra-config '{json.dumps({**client, "init_bm": False})}'
        """))


if __name__ == "__main__":
    sys.exit(main())
