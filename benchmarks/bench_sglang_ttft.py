#!/usr/bin/env python3
"""Time to first token on a real SGLang server (CPU): cold prefill vs KV restored from the L3 pool.

    "$(bash .ci/sglang_env.sh | tail -1)/bin/python" benchmarks/bench_sglang_ttft.py [--prompts 3]

Starts a MetaService and SGLang (``--hicache-storage-backend npu_memcache``, write-through, page
128) with a random Llama big enough that prefill dominates on this CPU (default 8 layers, hidden
1024, 16 heads, 8 KV heads). For each of ``--prompts`` distinct prompts of ``--tokens`` tokens:
a cold request (computes and writes the KV to L3), ``/flush_cache`` (device and host caches
dropped), then the same prompt again, served from L3 (checked: storage hit, same text), then once
more from the device cache (the floor: the same tokens left to compute, nothing to load).
TTFT is the latency of a request generating one token. Prints both medians and their ratio, and
memcpy of the restored bytes in this process as the reference.

``--disk DIR``: the server's segment gets a disk tier in DIR (``write_through``); after the device
hit, the prompt's pages are evicted to disk (the tier call ``evict``, checked: no DRAM copy left),
the caches flushed, and the prompt restored once more, from disk. ``--disk-prefetch off`` turns off
the backend's promotion of counted disk pages (``disk_prefetch``), to compare.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests
from memcache_sglang import testing as harness

from memcache_core.testing import wait_for

PAGE = 128


def ttft(server: harness.ServerHandle, ids: list[int]) -> tuple[float, str, dict]:
    start = time.perf_counter()
    r = requests.post(f"{server.url}/generate", timeout=600, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    body = r.json()
    return elapsed, body["text"], body["meta_info"].get("cached_tokens_details") or {}


def key_count(meta: harness.MetaHandle) -> int:
    return meta.admin("/get_all_keys")["count"]


def wait_written(meta: harness.MetaHandle, before: int, pages: int, timeout_s: float = 120) -> None:
    wait_for(lambda: key_count(meta) - before >= pages, timeout_s, f"write-through to store {pages} pages",
             interval_s=0.2)


def pool_client(meta: harness.MetaHandle) -> Any:
    from memcache_core.config import LocalConfig
    from memcache_core.local.store import open_store

    cfg = LocalConfig(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url,
                      protocol="host_shm", client_timeout_seconds=5)
    return open_store(cfg, 0, init_bm=False)


def evict_to_disk(meta: harness.MetaHandle, client: Any, keys: set[str], timeout_s: float = 120) -> None:
    """The prompt's pages on disk only (waits for write-through copies still queued); checked."""
    todo, deadline = sorted(keys), time.monotonic() + timeout_s
    while todo:
        todo = [k for k, c in zip(todo, client.evict(todo), strict=True) if c != 0]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(todo)} pages never reached the disk")
        time.sleep(0.2 if todo else 0)
    found = meta.admin("/batch_query_keys?keys=" + ",".join(sorted(keys)))["keys"]
    assert all(f["exists"] and not f["locations"] for f in found), "a page kept a DRAM copy"


def memcpy_seconds(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=3200)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--plot", metavar="PNG", help="draw cold / restored / device-hit TTFT bars into this PNG "
                   "(bench extra)")
    p.add_argument("--disk", metavar="DIR", help="give the server a disk tier in DIR; add a restore from disk")
    p.add_argument("--disk-prefetch", choices=("on", "off"), default="on")
    args = p.parse_args()
    model = harness.ensure_model(sys.executable, [
        "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
        "--kv-heads", str(args.kv_heads), "--max-pos", "8192"])
    pages = args.tokens // PAGE
    kv_bytes = pages * PAGE * args.layers * 2 * args.kv_heads * (args.hidden // args.heads) * 2
    print(f"model {model}\nprompt {args.tokens} tokens ({pages} full pages, {kv_bytes / 2**20:.1f} MiB of KV)")
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        meta = harness.start_meta(tmp)
        try:
            disk = {"disk_path": args.disk, "disk_size": "8GB", "disk_write_policy": "write_through",
                    "disk_prefetch": args.disk_prefetch == "on"} if args.disk else {}
            server = harness.start_server(harness.free_port(), meta, model=model,
                                          log_path=Path(tmp) / "server.log",
                                          extra_config={"dram_size": "2GB", **disk})
            client = pool_client(meta) if args.disk else None
            try:
                ttft(server, [5] * 64)  # warm-up
                cold_s, restored_s, device_s, disk_s = [], [], [], []
                for i in range(args.prompts):
                    rng = random.Random(1000 + i)
                    ids = [rng.randrange(10, 32000) for _ in range(args.tokens)]
                    before, before_keys = key_count(meta), set(meta.admin("/get_all_keys")["keys"])
                    t_cold, text_cold, d_cold = ttft(server, ids)
                    assert not d_cold.get("device") and not d_cold.get("storage"), d_cold
                    wait_written(meta, before, pages)
                    requests.post(f"{server.url}/flush_cache", timeout=60).raise_for_status()
                    t_l3, text_l3, d_l3 = ttft(server, ids)
                    assert d_l3.get("storage", 0) >= (pages - 1) * PAGE and not d_l3.get("device"), d_l3
                    assert text_l3 == text_cold, "restored KV produced a different token"
                    t_dev, text_dev, d_dev = ttft(server, ids)
                    assert d_dev.get("device", 0) >= (pages - 1) * PAGE and text_dev == text_cold, d_dev
                    cold_s.append(t_cold)
                    restored_s.append(t_l3)
                    device_s.append(t_dev)
                    print(f"prompt {i}: cold {t_cold * 1e3:8.1f} ms   restored from L3 {t_l3 * 1e3:8.1f} ms "
                          f"(storage hit {d_l3.get('storage')} tokens)   device hit {t_dev * 1e3:8.1f} ms")
                    if client is not None:
                        evict_to_disk(meta, client, set(meta.admin("/get_all_keys")["keys"]) - before_keys)
                        requests.post(f"{server.url}/flush_cache", timeout=60).raise_for_status()
                        t_disk, text_disk, d_disk = ttft(server, ids)
                        assert d_disk.get("storage", 0) >= (pages - 1) * PAGE, d_disk
                        assert text_disk == text_cold, "KV restored from disk produced a different token"
                        disk_s.append(t_disk)
                        print(f"prompt {i}: restored from disk {t_disk * 1e3:8.1f} ms "
                              f"(disk_prefetch {args.disk_prefetch})")
            finally:
                if client is not None:
                    client.close()
                server.stop()
        finally:
            meta.stop()
    cold, l3, dev = (statistics.median(x) for x in (cold_s, restored_s, device_s))
    print(f"median TTFT cold {cold * 1e3:.1f} ms, restored from L3 {l3 * 1e3:.1f} ms, "
          f"speed-up {cold / l3:.1f}x; device-cache hit {dev * 1e3:.1f} ms (L3 restore overhead "
          f"{(l3 - dev) * 1e3:.1f} ms)")
    print(f"reference: memcpy of {kv_bytes / 2**20:.1f} MiB in this process {memcpy_seconds(kv_bytes) * 1e3:.1f} ms")
    bars = {"cold": cold_s, "restored from L3": restored_s, "device-cache hit": device_s}
    if disk_s:
        print(f"median TTFT restored from disk {statistics.median(disk_s) * 1e3:.1f} ms "
              f"(disk_prefetch {args.disk_prefetch})")
        bars = {"cold": cold_s, "from DRAM": restored_s, "from disk": disk_s, "device-cache hit": device_s}
    if args.plot:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import plots
        print("plot:", plots.ttft_bars(bars, args.plot, f"SGLang, {args.tokens}-token prompts"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
