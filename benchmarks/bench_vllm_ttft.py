#!/usr/bin/env python3
"""Time to first token with vLLM: prompt computed (cold) versus its KV loaded from the MemCache pool.

    python benchmarks/bench_vllm_ttft.py [--model DIR] [--prompt-tokens 2000] [--prompts 3]

Starts a pool (MetaService + a standalone LocalService), then two vLLM instances in turn, each in
fresh processes with the MemCacheConnector and the local prefix cache off:

1. cold: each of ``--prompts`` distinct long prompts is computed (the lookup misses) and its
   blocks are saved to the pool;
2. loaded: a new instance gets the same prompts; all but the last partial block come from the pool.

TTFT is the wall time of a 1-token generate. Prints both medians and their ratio. Without
``--model`` it makes a random Llama large enough (8 layers, hidden 1024) that prefill dominates on
a CPU. Needs the vLLM environment (``.ci/vllm_env.sh``).

``--disk DIR``: the LocalService gets a disk tier in DIR (``write_through``), and a third instance
runs after every saved block was evicted to disk (the tier call ``evict``, checked: no DRAM copy
left): 3. from disk, each block read from the provider's disk tier (direct I/O where DIR's
filesystem takes it). Also prints the disk's raw sequential read speed, measured on an equally
large file in DIR with the same kind of I/O.

Partial hits: after the full hits, the loaded instance runs prompts of the same length whose first
half and first three quarters (whole blocks) are the saved prompts' and the rest new: those blocks
come from the pool, the rest is computed (and saved). The table prints, per hit, the median TTFT
beside the cold one, and the connector's load and save times (``load_time_s``, ``save_time_s``) per prompt.

``--layerwise``: two more instances with ``use_layerwise`` (docs/vllm.md "Layer-wise"): one restores
the same full and partial hits layer by layer (loads overlap the forward; the partial hits' new part
is other tokens than the whole-block instance's, so that neither finds the other's saves), the wait
of the forward for a layer (``layer_wait_s``) printed beside the load time; one computes other
prompts and saves them layer by layer (inside the step, where the whole-block path saves in the
background). Then, on one prompt's worth of the saved objects, the copy calls each path makes: one
``batch_get_into_layers`` of every block against describe + lease, one ``batch_copy_layers`` per
layer, and unlease (medians of 5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BLOCK = 32


def prompt(n: int, seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 31000 + 10 for i in range(n)]


def run_instance(spec_path: str, out_path: str) -> None:
    """One engine lifetime (runs in a child process)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], block_size=BLOCK, enforce_eager=True, dtype="bfloat16",
              max_model_len=spec["max_model_len"], enable_prefix_caching=False, seed=0,
              kv_transfer_config=KVTransferConfig(**spec["kv_transfer_config"]), disable_log_stats=False)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": prompt(64, 999)}], params, use_tqdm=False)  # warm-up
    results = []
    for label, p in spec["prompts"]:
        before = connector_seconds()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        ttft = time.perf_counter() - t0
        after = connector_seconds()
        results.append({"hit": label, "ttft_s": ttft, "cached": out.num_cached_tokens,
                        "token": out.outputs[0].token_ids[0],
                        **{name: after[name] - before[name] for name in after}})
    Path(out_path).write_text(json.dumps(results))


def connector_seconds() -> dict[str, float]:
    """The connector's ``load_time_s``, ``layer_wait_s`` and ``save_time_s`` counters so far (docs/vllm.md "Observability"),
    read from the Prometheus registry: ``LLM.get_metrics`` rounds counters down to whole numbers."""
    from prometheus_client import REGISTRY

    names = {"vllm:memcache_load_time_s_total": "load_s", "vllm:memcache_layer_wait_s_total": "wait_s",
             "vllm:memcache_save_time_s_total": "save_s"}
    got = dict.fromkeys(names.values(), 0.0)
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name in names:
                got[names[sample.name]] += sample.value
    return got


def hit_prompts(n: int, seeds: list[int], instance: int) -> list[tuple[str, list[int]]]:
    """Full hits of the saved prompts, then partial hits: their first half and three quarters (whole
    blocks), the rest new tokens of this ``instance``'s own."""
    out = [("full", prompt(n, seed)) for seed in seeds]
    for j, (label, frac) in enumerate((("3/4", 0.75), ("1/2", 0.5))):
        cut = int(n * frac) // BLOCK * BLOCK
        out += [(label, prompt(n, seed)[:cut] + prompt(n - cut, 1000 * instance + 100 * j + seed)) for seed in seeds]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: make a random 8-layer Llama)")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--instance", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--plot", metavar="PNG", help="draw cold vs loaded TTFT bars into this PNG (bench extra)")
    ap.add_argument("--disk", metavar="DIR", help="give the pool a disk tier in DIR and add a restore from disk")
    ap.add_argument("--layerwise", action="store_true", help="add a restore and a cold run with use_layerwise")
    ap.add_argument("--prefetch-layers", type=int, default=1, help="layerwise_prefetch_layers (with --layerwise)")
    args = ap.parse_args()
    if args.instance:
        run_instance(*args.instance)
        return 0

    from memcache_core.testing import running_meta_service, start_local_service

    model = args.model
    if model is None:
        made = subprocess.run(
            [sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--layers", "8",
             "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--name", "llama-8l-1024-bench"],
            check=True, capture_output=True, text=True)
        model = made.stdout.strip().splitlines()[-1]
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-ttft-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "integrations"), str(REPO), env.get("PYTHONPATH", "")])
    seeds = list(range(1, args.prompts + 1))
    with running_meta_service() as meta:
        disk = {"disk_path": str(Path(args.disk) / "tier"), "disk_size": "8GB",
                "disk_write_policy": "write_through"} if args.disk else {}
        local, _ = start_local_service({"meta_service_url": meta.meta_service_url,
                                        "config_store_url": meta.config_store_url,
                                        "protocol": "host_shm", "dram_size": "2GB", **disk},
                                       work, lambda: meta.http("/get_all_segments").get("segments", []),
                                       name="local", env=env)
        try:
            ktc = {"kv_connector": "MemCacheConnector", "kv_connector_module_path": "memcache_vllm",
                   "kv_role": "kv_both",
                   "kv_connector_extra_config": {"meta_service_url": meta.meta_service_url,
                                                 "config_store_url": meta.config_store_url,
                                                 "protocol": "host_shm", "dram_size": "0"}}
            n = args.prompt_tokens
            spec = {"model": model, "prompts": [("cold", prompt(n, seed)) for seed in seeds],
                    "max_model_len": n + 64, "kv_transfer_config": ktc}
            lw_ktc = json.loads(json.dumps(ktc))
            lw_ktc["kv_connector_extra_config"].update(use_layerwise=True,
                                                      layerwise_prefetch_layers=args.prefetch_layers)
            specs = {"cold": spec, "loaded": {**spec, "prompts": hit_prompts(n, seeds, 1)},
                     "disk": {**spec, "prompts": [("full", prompt(n, seed)) for seed in seeds]},
                     "layerwise": {**spec, "kv_transfer_config": lw_ktc, "prompts": hit_prompts(n, seeds, 2)},
                     "layerwise cold": {**spec, "kv_transfer_config": lw_ktc,
                                        "prompts": [("cold", prompt(n, seed + 100)) for seed in seeds]}}
            phases = ["cold", "loaded"] + (["layerwise", "layerwise cold"] if args.layerwise else []) + \
                (["disk"] if args.disk else [])
            runs = {}
            for phase in phases:
                if phase == "disk":
                    evict_everything(meta)
                name = phase.replace(" ", "_")
                (work / f"{name}.spec.json").write_text(json.dumps(specs[phase]))
                out = work / f"{name}.json"
                subprocess.run([sys.executable, __file__, "--instance", str(work / f"{name}.spec.json"), str(out)],
                               check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                runs[phase] = json.loads(out.read_text())
            if args.layerwise:
                calls = copy_calls(meta, model, (n - 1) // BLOCK)
        finally:
            local.terminate()
            local.wait(30)
    cold = [r["ttft_s"] for r in runs["cold"]]
    full_hits = [r for r in runs["loaded"] if r["hit"] == "full"]
    loaded = [r["ttft_s"] for r in full_hits]
    same = all(a["token"] == b["token"] for a, b in zip(runs["cold"], full_hits, strict=True))
    print(f"model {model}, prompt {args.prompt_tokens} tokens, {args.prompts} prompts, block {BLOCK}")
    print(f"cold   TTFT median {statistics.median(cold) * 1000:9.1f} ms  (cached tokens "
          f"{[r['cached'] for r in runs['cold']]})")
    print(f"loaded TTFT median {statistics.median(loaded) * 1000:9.1f} ms  (cached tokens "
          f"{[r['cached'] for r in full_hits]})")
    print(f"speed-up cold/loaded {statistics.median(cold) / statistics.median(loaded):.1f}x; "
          f"first tokens identical: {same}")
    if args.layerwise:
        report_layerwise(runs)
        print(calls)
    report_hits(runs)
    bars = {"cold": cold, "loaded from the pool": loaded}
    if args.disk:
        bars = {"cold": cold, "from DRAM": loaded, "from disk": report_disk(runs, Path(args.disk))}
    if args.plot:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import plots
        print("plot:", plots.ttft_bars(bars, args.plot, f"vLLM, {args.prompt_tokens}-token prompts"))
    return 0


def report_layerwise(runs: dict[str, Any]) -> None:
    """The restore and the cold run with use_layerwise beside the whole-block ones."""
    lw = [r for r in runs["layerwise"] if r["hit"] == "full"]
    lw_cold = runs["layerwise cold"]
    same = all(a["token"] == b["token"] for a, b in zip(runs["cold"], lw, strict=True))
    print(f"layer-wise restore TTFT median {statistics.median(r['ttft_s'] for r in lw) * 1000:9.1f} ms  (cached "
          f"tokens {[r['cached'] for r in lw]}); first tokens identical: {same}")
    print(f"layer-wise cold    TTFT median {statistics.median(r['ttft_s'] for r in lw_cold) * 1000:9.1f} ms  "
          f"(saves inside the step; cached tokens {[r['cached'] for r in lw_cold]})")


def report_hits(runs: dict[str, Any]) -> None:
    """Full and partial hits side by side: median TTFT, and the connector's median load and save
    times per prompt (layer-wise: the load runs beside the forward, wait is how long the forward
    stalled for a layer, and the save of the new blocks ends inside the step; whole blocks: the save
    runs after the step)."""
    cold = statistics.median(r["ttft_s"] for r in runs["cold"]) * 1000
    print(f"{'hit':<5} {'cached':>7} {'cold ms':>9} {'whole-block ms':>15} {'(load':>7} {'save)':>7} "
          f"{'layer-wise ms':>14} {'(load':>7} {'wait':>5} {'save)':>7}")
    for hit in ("full", "3/4", "1/2"):
        row = [r for r in runs["loaded"] if r["hit"] == hit]
        lw = [r for r in runs.get("layerwise", []) if r["hit"] == hit]
        med = lambda rs, k: f"{statistics.median(r[k] for r in rs) * 1000:.1f}" if rs else "-"   # noqa: E731
        print(f"{hit:<5} {statistics.median(r['cached'] for r in row):>7.0f} {cold:>9.1f} "
              f"{med(row, 'ttft_s'):>15} {med(row, 'load_s'):>7} {med(row, 'save_s'):>7} {med(lw, 'ttft_s'):>14} "
              f"{med(lw, 'load_s'):>7} {med(lw, 'wait_s'):>5} {med(lw, 'save_s'):>7}")


def copy_calls(meta: Any, model: str, n_blocks: int, reps: int = 5) -> str:
    """The copies of ``n_blocks`` saved objects into a layer-major buffer (as the KV caches are laid
    out), both ways: one ``batch_get_into_layers`` (the whole-block load) against describe + lease,
    one ``batch_copy_layers`` per layer and unlease (the layer-wise load). Medians of ``reps``."""
    import ctypes
    import mmap

    from memcache_core import G2H
    from memcache_core.local.store import open_store

    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    store = open_store(meta.local_config(), 0, init_bm=False)
    try:
        keys = sorted(meta.http("/get_all_keys")["keys"])[:n_blocks]
        size = store.batch_get_key_info(keys[:1], 1)[0].size()
        piece = size // layers
        buf = mmap.mmap(-1, len(keys) * size)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert store.register_buffer(base, len(keys) * size) == 0
        at = lambda layer, k: base + (layer * len(keys) + k) * piece   # noqa: E731
        whole, info, per_layer, unlease = [], [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            rc = store.batch_get_into_layers(keys, [[at(lay, k) for lay in range(layers)] for k in range(len(keys))],
                                             [[piece] * layers] * len(keys))
            whole.append(time.perf_counter() - t0)
            assert rc == [0] * len(keys), rc
            want, buf[:] = bytes(buf), bytes(len(buf))
            t0 = time.perf_counter()
            gvas = [i.gva_list()[0] for i in store.batch_get_key_info(keys, 1)]
            assert store.batch_add_lease(keys, 10_000) == [0] * len(keys)
            info.append(time.perf_counter() - t0)
            for lay in range(layers):
                t0 = time.perf_counter()
                assert store.batch_copy_layers([g + lay * piece for g in gvas], [[at(lay, k)] for k in range(len(keys))],
                                               [[piece]] * len(keys), G2H) == 0
                per_layer.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            store.batch_remove_lease(keys)
            unlease.append(time.perf_counter() - t0)
            assert bytes(buf) == want, "the layer-wise copies differ from the whole-block copy"
    finally:
        store.close()
    ms = lambda xs: statistics.median(xs) * 1000   # noqa: E731
    return (f"copy calls for {len(keys)} objects of {size / 1024:.0f} KiB ({layers} layers): whole-block one "
            f"batch_get_into_layers {ms(whole):.2f} ms; layer-wise describe+lease {ms(info):.2f} ms + {layers} x "
            f"batch_copy_layers {ms(per_layer):.2f} ms + unlease {ms(unlease):.2f} ms = "
            f"{ms(info) + layers * ms(per_layer) + ms(unlease):.2f} ms")


def evict_everything(meta: Any) -> None:
    """Every object of the pool on the disk tier only (waits for write-through copies still queued)."""
    from memcache_core.local.store import open_store

    store = open_store(meta.local_config(), 0, init_bm=False)
    try:
        keys = list(meta.http("/get_all_keys")["keys"])
        deadline = time.monotonic() + 120
        while keys:
            keys = [k for k, c in zip(keys, store.evict(keys), strict=True) if c != 0]
            assert time.monotonic() < deadline, f"{len(keys)} objects never reached the disk"
            time.sleep(0.2 if keys else 0)
        found = meta.http("/batch_query_keys?keys=" + ",".join(meta.http("/get_all_keys")["keys"]))["keys"]
        assert all(f["exists"] and not f["locations"] for f in found), "an object kept a DRAM copy"
    finally:
        store.close()


def report_disk(runs: dict[str, Any], disk: Path) -> list[float]:
    """Print the restore from disk beside the raw read speed of the disk; its TTFT figures."""
    ttfts = [r["ttft_s"] for r in runs["disk"]]
    same = all(a["token"] == b["token"] for a, b in zip(runs["cold"], runs["disk"], strict=True))
    records = sorted((disk / "tier").rglob("*"))
    nbytes = sum(f.stat().st_size for f in records if f.is_file())
    print(f"disk   TTFT median {statistics.median(ttfts) * 1000:9.1f} ms  (cached tokens "
          f"{[r['cached'] for r in runs['disk']]}); first tokens identical: {same}")
    secs = raw_read_seconds(disk, nbytes)
    print(f"reference: the disk tier holds {nbytes / 2**20:.1f} MiB; reading that many bytes from one file in "
          f"{disk} takes {secs * 1000:.1f} ms ({nbytes / secs / 1e9:.2f} GB/s)")
    return ttfts


def raw_read_seconds(directory: Path, nbytes: int, chunk: int = 4 << 20) -> float:
    """Sequential read of a fresh ``nbytes`` file in ``directory``, written and read with direct I/O
    where the filesystem takes it (the page cache would otherwise serve the read)."""
    import mmap

    direct = getattr(os, "O_DIRECT", 0)
    path = directory / "raw-read-probe"
    buf = mmap.mmap(-1, chunk)   # page-aligned, as direct I/O needs
    buf.write(os.urandom(chunk))
    nbytes = max(chunk, nbytes // chunk * chunk)
    try:
        try:
            flags = direct
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        except OSError:   # no direct I/O here (tmpfs): buffered, as the disk tier does
            flags = 0
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(nbytes // chunk):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            t0 = time.perf_counter()
            while os.readv(fd, [buf]) > 0:
                pass
            return time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        buf.close()
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
