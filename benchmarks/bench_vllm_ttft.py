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
              kv_transfer_config=KVTransferConfig(**spec["kv_transfer_config"]))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": prompt(64, 999)}], params, use_tqdm=False)  # warm-up
    results = []
    for seed in spec["seeds"]:
        p = prompt(spec["prompt_tokens"], seed)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        results.append({"ttft_s": time.perf_counter() - t0, "cached": out.num_cached_tokens,
                        "token": out.outputs[0].token_ids[0]})
    Path(out_path).write_text(json.dumps(results))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: make a random 8-layer Llama)")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--instance", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--plot", metavar="PNG", help="draw cold vs loaded TTFT bars into this PNG (bench extra)")
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
        local, _ = start_local_service({"meta_service_url": meta.meta_service_url,
                                        "config_store_url": meta.config_store_url,
                                        "protocol": "host_shm", "dram_size": "2GB"},
                                       work, lambda: meta.http("/get_all_segments").get("segments", []),
                                       name="local", env=env)
        try:
            ktc = {"kv_connector": "MemCacheConnector", "kv_connector_module_path": "memcache_vllm",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"meta_service_url": meta.meta_service_url,
                                                 "config_store_url": meta.config_store_url,
                                                 "protocol": "host_shm", "dram_size": "0"}}
            spec = {"model": model, "seeds": seeds, "prompt_tokens": args.prompt_tokens,
                    "max_model_len": args.prompt_tokens + 64, "kv_transfer_config": ktc}
            (work / "spec.json").write_text(json.dumps(spec))
            runs = {}
            for phase in ("cold", "loaded"):
                out = work / f"{phase}.json"
                subprocess.run([sys.executable, __file__, "--instance", str(work / "spec.json"), str(out)],
                               check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                runs[phase] = json.loads(out.read_text())
        finally:
            local.terminate()
            local.wait(30)
    cold = [r["ttft_s"] for r in runs["cold"]]
    loaded = [r["ttft_s"] for r in runs["loaded"]]
    same = all(a["token"] == b["token"] for a, b in zip(runs["cold"], runs["loaded"], strict=True))
    print(f"model {model}, prompt {args.prompt_tokens} tokens, {args.prompts} prompts, block {BLOCK}")
    print(f"cold   TTFT median {statistics.median(cold) * 1000:9.1f} ms  (cached tokens "
          f"{[r['cached'] for r in runs['cold']]})")
    print(f"loaded TTFT median {statistics.median(loaded) * 1000:9.1f} ms  (cached tokens "
          f"{[r['cached'] for r in runs['loaded']]})")
    print(f"speed-up cold/loaded {statistics.median(cold) / statistics.median(loaded):.1f}x; "
          f"first tokens identical: {same}")
    if args.plot:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import plots
        print("plot:", plots.ttft_bars({"cold": cold, "loaded from the pool": loaded}, args.plot,
                                       f"vLLM, {args.prompt_tokens}-token prompts"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
