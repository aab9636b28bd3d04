"""Run one vLLM engine lifetime in this (fresh) process and report what it produced, as JSON.

    python llm_runner.py SPEC.json OUT.json

SPEC: {"model": DIR, "block_size": 32, "dtype": "bfloat16", "kv_transfer_config": {...} | null,
       "enable_prefix_caching": bool, "max_model_len": N, "num_gpu_blocks_override": N,
       "steps": [STEP, ...]}
STEP: {"generate": [[token ids], ...], "max_tokens": N, "batch": false}
                                                         -> one result per prompt (all prompts
                                                            submitted at once with "batch")
      {"wait_for_file": PATH}                               -> blocks until PATH exists (the test
                                                                changes the world meanwhile)
      {"signal_file": PATH}                                 -> creates PATH
      {"reset_prefix_cache": {"reset_connector": bool}}     -> the call's return value
      {"scale_weights": {"match": "v_proj", "factor": F}}   -> multiplies every matching weight
                                                                by F in the workers (a weight update)
      {"failed_load": {"first": [ids], "then": "abort" | "preempt" | "share",
                       "second": [ids] | null}, "max_tokens": N}
                                                            -> A loads (part fails), is aborted,
                                                               preempted or left running, C joins
                                                               (engine_in_process only)
A STEP with "lora": [name, int id, path] generates with that LoRA adapter.
SPEC may also carry "kv_events_config" (vLLM's KVEventsConfig fields), "hf_overrides", "kv_cache_dtype", "enable_lora", "max_lora_rank",
"tensor_parallel_size" (each rank's worker bound to its share of this process's CPUs), and
"engine_in_process": true (vLLM's engine core in this process, not its own: the requests of a batch
step are then all scheduled together, from the first step on).
OUT: {"steps": [[{"token_ids", "logprobs", "num_cached_tokens", "elapsed_s"}, ...] | null, ...],
      "metrics": {name: value}, "startup_s": float}

A separate process per lifetime is the point: nothing survives between two engines but the pool.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from memcache_core.testing import wait_for

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Same thread count with and without a connector, so logprobs are comparable bit for bit.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
# Weight updates in tests send a function to the workers.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            out[m.name] = out.get(m.name, 0) + float(value)
    return out


def _output(out: Any, elapsed: float) -> dict[str, Any]:
    comp = out.outputs[0]
    return {
        "token_ids": list(comp.token_ids),
        "logprobs": [lp[tok].logprob for lp, tok in zip(comp.logprobs or [], comp.token_ids, strict=False)],
        "num_cached_tokens": out.num_cached_tokens,
        "finish_reason": comp.finish_reason,
        "elapsed_s": elapsed,
    }


def _failed_load(llm: Any, case: dict[str, Any], params: Any) -> list[dict[str, Any]]:
    """Request "A" (``first``) runs one step, the one that loads its blocks (the faulty connector
    makes part of the load fail; vLLM reschedules A). Then, per ``then``: "abort" A, "preempt" A
    (as vLLM's scheduler does when it runs out of blocks), or nothing; request "C" (``second``,
    if any) is added, and the engine steps until every request is done. Needs
    ``engine_in_process``. Returns the outputs of A (unless aborted), then of C."""
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    done: dict[str, Any] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out

    t = time.perf_counter()
    engine.add_request("A", {"prompt_token_ids": case["first"]}, params)
    step()
    assert "A" not in done, "A must still run after the step that loaded its blocks"
    if case["then"] == "abort":
        engine.abort_request(["A"])
    elif case["then"] == "preempt":
        (req,) = list(sched.running)
        sched.running.remove(req)
        sched._preempt_request(req, time.monotonic(), drop_stale_output=True)
        sched.prev_step_scheduled_req_ids.discard(req.request_id)
    if case.get("second"):
        engine.add_request("C", {"prompt_token_ids": case["second"]}, params)
    while engine.has_unfinished_requests():
        step()
    return [_output(done[rid], time.perf_counter() - t) for rid in ("A", "C") if rid in done]


def bind_ranks(tp: int) -> None:
    """vLLM on CPU binds the threads of rank ``r`` to NUMA node ``r`` and refuses more ranks than
    nodes: unless told otherwise, give each rank its share of this process's CPUs instead."""
    cpus = sorted(os.sched_getaffinity(0))
    shares = [cpus[r * len(cpus) // tp:(r + 1) * len(cpus) // tp] or cpus[r % len(cpus):][:1] for r in range(tp)]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, s)) for s in shares))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("tensor_parallel_size", 1) > 1:
        bind_ranks(spec["tensor_parallel_size"])
    if spec.get("engine_in_process"):
        # The engine core runs in this process: a batch's requests all reach the scheduler before
        # its first step, instead of racing that step over a socket.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(
        model=spec["model"], block_size=spec.get("block_size", 32), dtype=spec.get("dtype", "bfloat16"),
        enforce_eager=True, max_model_len=spec.get("max_model_len", 4096), seed=0,
        enable_prefix_caching=spec.get("enable_prefix_caching", False), disable_log_stats=False,
    )
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks_override"]
    for key in ("hf_overrides", "kv_cache_dtype", "enable_lora", "max_lora_rank", "tensor_parallel_size"):
        if spec.get(key) is not None:
            kwargs[key] = spec[key]
    if spec.get("kv_events_config"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "steps": []}
    for step in spec["steps"]:
        if "wait_for_file" in step:
            wait_for(Path(step["wait_for_file"]).exists, step.get("timeout_s", 300), step["wait_for_file"])
            result["steps"].append(None)
            continue
        if "signal_file" in step:
            Path(step["signal_file"]).write_text("ok")
            result["steps"].append(None)
            continue
        if "reset_prefix_cache" in step:
            ok, deadline = llm.reset_prefix_cache(**step["reset_prefix_cache"]), time.monotonic() + 60
            while not ok and spec.get("engine_in_process") and time.monotonic() < deadline:
                # Blocks of finished requests are freed once their asynchronous saves are done, in a
                # step: in its own process the engine core steps by itself, here nothing else does.
                llm.llm_engine.step()
                time.sleep(0.01)
                ok = llm.reset_prefix_cache(**step["reset_prefix_cache"])
            result["steps"].append(ok)
            continue
        if "scale_weights" in step:
            import functools

            from weight_update import scale_weights

            result["steps"].append(llm.apply_model(functools.partial(scale_weights, **step["scale_weights"])))
            continue
        if "failed_load" in step:
            params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, logprobs=1,
                             ignore_eos=True)
            result["steps"].append(_failed_load(llm, step["failed_load"], params))
            continue
        lora = None
        if step.get("lora"):
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(*step["lora"])
        params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, logprobs=1,
                                ignore_eos=True)
        batches = [step["generate"]] if step.get("batch") else [[p] for p in step["generate"]]
        produced: list[tuple[Any, float]] = []
        for batch in batches:
            t = time.perf_counter()
            got = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False,
                               lora_request=lora)
            produced.extend((out, time.perf_counter() - t) for out in got)
        result["steps"].append([_output(out, elapsed) for out, elapsed in produced])
    result["metrics"] = _metrics(llm)
    Path(sys.argv[2]).write_text(json.dumps(result))
    del llm


if __name__ == "__main__":
    main()
