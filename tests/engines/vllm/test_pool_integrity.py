"""The pool is never poisoned and keys name the bytes, against real vLLM engines (issue 15).

* Blocks computed over a block that failed to load never stay in the pool (item 1).
* A model the connector cannot serve (sliding-window KV cache, vLLM's null block) is refused at
  start-up (item 2).
* Another checkpoint under the same directory name, a rope override, and a tenant prefix that
  sanitizes to another tenant's never read each other's blocks (items 3, 4, 8).
* ``reset_prefix_cache(reset_connector=True)`` after a weight update returns True, and the
  instance never again reads a block written before it (item 5).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    BLOCK,
    MAX_TOKENS,
    P1,
    P3,
    P4,
    P5,
    PROMPTS,
    REPO,
    Engine,
    Pool,
    assert_same_output,
    full_hit,
    metric,
    tokens,
    write_adapter,
)

from memcache_core.testing import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]

P1_BLOCKS = len(P1) // BLOCK
RUNNER = tokens(1500, 9)


def gen(*prompts: list[int], batch: bool = False) -> dict[str, Any]:
    return {"generate": list(prompts), "max_tokens": MAX_TOKENS, "batch": batch}


def wait_all(*engines: Engine) -> list[dict[str, Any]]:
    return [e.result() for e in engines]


def release_when_saved(pool: Pool, engine: Engine, ready: Path, go: Path,
                       saved: Callable[[list[str]], bool], timeout_s: float = 420) -> None:
    """Saves are asynchronous: once ``engine`` signals ``ready``, wait until the pool holds what
    it saved (``saved(keys)``), then let it go on (``go``)."""
    deadline = time.monotonic() + timeout_s

    def got_ready() -> bool:
        assert engine.proc.poll() is None, f"{engine.name} died:\n{engine.log.read_text()[-3000:]}"
        return ready.exists()

    wait_for(got_ready, timeout_s, f"{engine.name} to get ready", interval_s=0.2)
    wait_for(lambda: saved(pool.keys()), max(0.0, deadline - time.monotonic()),
             f"{engine.name}'s blocks to reach the pool", interval_s=0.2)
    go.write_text("go")


def test_blocks_computed_over_a_failed_load_never_stay_in_the_pool(pool: Pool, engines,
                                                                   baseline) -> None:
    """Scenario: instance E saves P1, clears its local prefix cache, then gets P1 (request A) and
    P5 = P1 + 150 tokens (request B) in one step, local prefix cache on. A loads P1's blocks from
    the pool, and half of them disappear before the load (fault injection); B reuses A's blocks
    through the local prefix cache in the same step, before A's load ran, and computes its own
    blocks over the failed ones. vLLM recovers both answers. A fresh instance then loads P5 from
    the pool: it must get the baseline's output, so B's blocks computed over the failed load never
    stayed in the pool.

    E runs vLLM's engine core in its own process (``engine_in_process``), so A and B both reach the
    scheduler before its first step and are scheduled together every time (across a socket they
    raced that step: about one run in three scheduled them apart on this 2-core machine). A long
    request (RUNNER) goes first in the same batch, as when this scenario was written: without it
    B's recovered logprobs came out different from the baseline's in the last bits (beyond the 1e-6
    the comparison allows; the tokens were the same). Two
    variants, side by side: the worker's fence keeps B's save from happening; and, with the fence
    off (as another tensor-parallel rank that did not see the failure would save), the scheduler's
    removal of the keys saved from that step. Each variant's counter proves its path ran."""
    writers = {}
    for variant in ("fenced", "unfenced"):
        extra = {"test_unfenced": True} if variant == "unfenced" else {}
        kv = pool.kv_transfer_config(module="faulty_connector", cache_prefix=f"ab-{variant}", **extra)
        writers[variant] = engines(f"writer_{variant}", [
            gen(P1), {"reset_prefix_cache": {"reset_connector": False}}, gen(RUNNER, P1, P5, batch=True)],
            kv, enable_prefix_caching=True, engine_in_process=True)
    results = dict(zip(writers, wait_all(*writers.values()), strict=True))
    readers = {v: engines(f"reader_{v}", [gen(P5)], pool.kv_transfer_config(cache_prefix=f"ab-{v}"))
               for v in writers}
    for variant, res in results.items():
        assert res["steps"][1] is True, variant
        _, a, b = res["steps"][2]
        assert a["num_cached_tokens"] == full_hit(P1), f"{variant}: A was offered the pool's blocks"
        assert metric(res, "memcache_load_failed_blocks") > 0, f"{variant}: the load must fail"
        assert_same_output(a, baseline["P1"], f"{variant}: A recovered by vLLM")
        assert_same_output(b, baseline["P5"], f"{variant}: B recovered by vLLM")
    assert metric(results["fenced"], "memcache_save_fenced_blocks") > 0, "the fence kept B's blocks out"
    assert metric(results["unfenced"], "memcache_save_fenced_blocks") == 0
    assert metric(results["unfenced"], "memcache_poisoned_removed") > 0, "the scheduler removed what B saved"
    for variant, reader in readers.items():
        out = reader.result()["steps"][0][0]
        assert out["num_cached_tokens"] == full_hit(P5), f"{variant}: the pool holds all of P5"
        assert_same_output(out, baseline["P5"], f"{variant}: P5 restored by a fresh instance")


def test_failed_blocks_are_never_hit_again_after_abort_preemption_or_sharing(
        pool: Pool, engines, baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario (issue 21, item 1): instance E saves P1, P3 and P4, clears its local prefix cache,
    then, one case after the other, request A loads a prompt's blocks from the pool and they
    disappear before the load (fault injection; all of them, so that every correct answer is
    computed from scratch, bit for bit the baseline's). vLLM (policy recompute) reschedules A;
    before A runs again:
    * abort: A (P1) is aborted; C, the same prompt, arrives. vLLM kept A's failed blocks in its
      prefix cache: C must not hit them, and its output is the baseline's;
    * preempt: A (P3) is preempted and resumes: it must not hit its own failed blocks;
    * share: A (P4) keeps running and C = P4 arrives in the next step: both get the baseline.
    A fresh instance then loads P1, P3 and P4 in full from the pool and gets exactly the
    baseline's tokens and logprobs: nothing computed over a failed block was saved. (The same
    prompts run alone, so that every answer is bit for bit the baseline's: a longer prompt, run
    alone with the local prefix cache on, differs from it in the last bits of its logprobs.)"""
    monkeypatch.setenv("MEMCACHE_TEST_DROP_FROM", "0")
    kv = pool.kv_transfer_config(module="faulty_connector", cache_prefix="poison")
    cases = [{"first": P1, "then": "abort", "second": P1}, {"first": P3, "then": "preempt"},
             {"first": P4, "then": "share", "second": P4}]
    e = engines("poison_writer", [gen(P1, P3, P4), {"reset_prefix_cache": {"reset_connector": False}}]
                + [{"failed_load": c, "max_tokens": MAX_TOKENS} for c in cases],
                kv, enable_prefix_caching=True, engine_in_process=True)
    res = e.result()
    assert res["steps"][1] is True
    (c_abort,), (a_preempt,), (a_share, c_share) = res["steps"][2:]
    assert metric(res, "memcache_load_failed_blocks") > 0, "the loads must fail"
    assert metric(res, "memcache_poisoned_evicted") > 0
    assert c_abort["num_cached_tokens"] == 0, "C hit none of the blocks that failed to load"
    assert_same_output(c_abort, baseline["P1"], "abort: C", across_shapes=True)   # alone vs batched
    assert_same_output(a_preempt, baseline["P3"], "preempt: A resumed", across_shapes=True)
    assert_same_output(a_share, baseline["P4"], "share: A", across_shapes=True)
    assert_same_output(c_share, baseline["P4"], "share: C in the next step", across_shapes=True)
    reader = engines("poison_reader", [gen(P1, P3, P4)], pool.kv_transfer_config(cache_prefix="poison"))
    for out, name in zip(reader.result()["steps"][0], ("P1", "P3", "P4"), strict=True):
        assert out["num_cached_tokens"] == full_hit(PROMPTS[name]), f"the pool holds all of {name}"
        assert_same_output(out, baseline[name], f"{name} restored by a fresh instance", across_shapes=True)


def test_load_failure_policy_fail_ends_the_request_and_is_warned_about(pool: Pool, engines) -> None:
    """Scenario (issue 21, item 4): vLLM's default kv_load_failure_policy is "fail", which the
    connector replaces with "recompute" (every other test here sets no policy and has its failed
    loads recomputed) unless ``load_failure_policy: "fail"`` in its extra config keeps it. Kept, the
    connector warns at start-up that a block evicted between lookup and load then fails the user's
    request, naming the remedy; and so it does: the request whose load fails ends with an error
    instead of an answer."""
    kv = pool.kv_transfer_config(module="faulty_connector", cache_prefix="policy-fail", load_failure_policy="fail")
    kv["kv_load_failure_policy"] = "fail"
    e = engines("policy_fail", [gen(P1), {"reset_prefix_cache": {"reset_connector": False}}, gen(P1)],
                kv, enable_prefix_caching=True, engine_in_process=True)
    res = e.result()
    assert "kv_load_failure_policy is 'fail'" in e.log.read_text()
    assert "kv_load_failure_policy='recompute'" in e.log.read_text()
    assert res["steps"][0][0]["finish_reason"] == "length"
    assert metric(res, "memcache_load_failed_blocks") > 0, "the load must fail"
    assert res["steps"][2][0]["finish_reason"] == "error"


def test_sliding_window_model_is_refused(pool: Pool, tiny_model: str, tmp_path: Path) -> None:
    """Scenario: every layer of the model uses a 64-token sliding window, so vLLM keeps only the
    blocks inside the window and pads the block table with its shared null block. The connector
    refuses the model at start-up with a message that says why, instead of loading into and
    saving from the null block."""
    spec = {"model": tiny_model, "block_size": BLOCK, "enable_prefix_caching": False,
            "hf_overrides": {"layer_types": ["sliding_attention", "sliding_attention"],
                             "sliding_window": 64},
            "kv_transfer_config": pool.kv_transfer_config(), "steps": [gen(P1)]}
    e = Engine(spec, tmp_path, "sliding")
    try:
        rc = e.proc.wait(420)
    finally:
        e.kill()
    log = e.log.read_text()
    assert rc != 0, "the engine must not start:\n" + log[-3000:]
    assert "MemCacheConnector cannot serve this model: its KV cache is SlidingWindowSpec" in log, \
        log[-3000:]


@pytest.fixture(scope="module")
def other_checkpoint(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Another tiny model (other weights) in a directory with the same last name."""
    out = tmp_path_factory.mktemp("other") / Path(tiny_model).name
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--out", str(out),
         "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--seed", "1"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out)


ROPE = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}


def test_other_checkpoint_rope_override_and_tenant_get_their_own_blocks(
        pool: Pool, engines, baseline, other_checkpoint: str, tmp_path: Path) -> None:
    """Scenario: the pool holds P1 as the tiny model computed it (no prefix). Three instances:
    * another checkpoint in a directory of the same name: P1 is a miss;
    * the same checkpoint with a rope override (hf_overrides), tenant ``tenant/a``: P1 is a miss
      (and its output is not the plain model's), then a hit on its own blocks with equal tokens;
    * the same overrides, tenant ``tenant_a`` (sanitizes to the same text), started after the
      second saved: P1 is a miss."""
    seed = engines("seed_plain", [gen(P1)], pool.kv_transfer_config())
    seed_out = seed.result()["steps"][0][0]
    assert_same_output(seed_out, baseline["P1"], "plain model")
    ready, go, saved = (tmp_path / n for n in ("rope_ready", "rope_go", "rope_saved"))
    other = engines("other_checkpoint", [gen(P1)], pool.kv_transfer_config(), model=other_checkpoint)
    rope = engines("rope_tenant_a", [gen(P1), {"signal_file": str(ready)}, {"wait_for_file": str(go)},
                                     gen(P1), {"signal_file": str(saved)}],
                   pool.kv_transfer_config(cache_prefix="tenant/a"), hf_overrides=ROPE)
    tenant = engines("rope_tenant_underscore", [{"wait_for_file": str(saved)}, gen(P1)],
                     pool.kv_transfer_config(cache_prefix="tenant_a"), hf_overrides=ROPE)
    # Until "tenant_a" starts, only "tenant/a" saves keys that read "mc@tenant_a@".
    release_when_saved(pool, rope, ready, go,
                       lambda keys: sum(k.startswith("mc@tenant_a@") for k in keys) >= P1_BLOCKS)
    r_other, r_rope, r_tenant = wait_all(other, rope, tenant)
    assert r_other["steps"][0][0]["num_cached_tokens"] == 0, "another checkpoint, same dir name"
    first, again = r_rope["steps"][0][0], r_rope["steps"][3][0]
    assert first["num_cached_tokens"] == 0, "a rope override is another model"
    assert first["token_ids"] != baseline["P1"]["token_ids"], "the override changes the output"
    assert again["num_cached_tokens"] == full_hit(P1), "the same settings share blocks"
    assert again["token_ids"] == first["token_ids"]
    assert r_tenant["steps"][1][0]["num_cached_tokens"] == 0, "tenant_a is not tenant/a"
    assert r_tenant["steps"][1][0]["token_ids"] == first["token_ids"]


def test_other_weights_swapped_in_at_the_same_path(pool: Pool, engines, baseline, tiny_model: str,
                                                   other_checkpoint: str, tmp_path: Path) -> None:
    """Scenario (issue 21, item 3): an instance serves the checkpoint at a path and saves P1. Then
    another checkpoint of the same shape is copied over the files at that path (same names, sizes
    and safetensors headers; new modification times). An instance started at that path must not
    load the old weights' blocks (its output is the other checkpoint's); it then loads its own."""
    swap = tmp_path / "model"
    shutil.copytree(tiny_model, swap)
    kv = pool.kv_transfer_config(cache_prefix="swap")
    old = engines("swap_old", [gen(P1)], kv, model=str(swap)).result()["steps"][0][0]
    assert_same_output(old, baseline["P1"], "the checkpoint first at the path")
    for src in Path(other_checkpoint).iterdir():
        if src.is_file():
            shutil.copyfile(src, swap / src.name)
    ready, go = tmp_path / "ready", tmp_path / "go"
    e = engines("swap_new", [gen(P1), {"signal_file": str(ready)}, {"wait_for_file": str(go)}, gen(P1)],
                kv, model=str(swap))
    release_when_saved(pool, e, ready, go, lambda keys: sum(
        k.startswith("mc@swap@") for k in keys) >= 2 * P1_BLOCKS)
    res = e.result()
    first, again = res["steps"][0][0], res["steps"][3][0]
    assert first["num_cached_tokens"] == 0, "blocks of the weights that were at this path were loaded"
    assert first["token_ids"] != baseline["P1"]["token_ids"], "the weights change the output"
    assert again["num_cached_tokens"] == full_hit(P1)
    assert again["token_ids"] == first["token_ids"]


def test_reset_cache_after_a_weight_update(pool: Pool, engines, baseline, tmp_path: Path) -> None:
    """Scenario: an instance computes P1 and saves it, then its weights change (every
    attention input norm scaled, as a weight update would; parameters used directly by the CPU
    kernels, unlike the prepacked linear weights) and it calls
    reset_prefix_cache(reset_connector=True). The call returns True; the next P1 is computed with
    the new weights (no block from before the reset is loaded) and differs from the old output;
    the one after loads the blocks saved after the reset; no key saved before the reset is left
    in the pool."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    e = engines("reset", [gen(P1), {"scale_weights": {"match": "input_layernorm", "factor": 1.5}},
                          {"reset_prefix_cache": {"reset_connector": True}}, gen(P1),
                          {"signal_file": str(ready)}, {"wait_for_file": str(go)}, gen(P1)],
                pool.kv_transfer_config(cache_prefix="reset-test"))
    release_when_saved(pool, e, ready, go, lambda keys: sum(
        k.startswith("mc@reset-test@") and "@e0@" not in k for k in keys) >= P1_BLOCKS)
    res = e.result()
    before, updated, after, again = (res["steps"][i] for i in (0, 1, 3, 6))
    assert_same_output(before[0], baseline["P1"], "before the update")
    assert updated == [2], "both layers' attention input norms scaled"
    assert res["steps"][2] is True, "reset_cache must report success"
    assert after[0]["num_cached_tokens"] == 0, "no block from before the reset"
    assert after[0]["token_ids"] != baseline["P1"]["token_ids"], "the new weights change the output"
    assert again[0]["num_cached_tokens"] == full_hit(P1)
    assert again[0]["token_ids"] == after[0]["token_ids"]
    keys = [k for k in pool.keys() if k.startswith("mc@reset-test@")]
    assert keys and not [k for k in keys if "@e0@" in k], keys[:3]


def test_lora_adapter_contents_are_part_of_the_key(pool: Pool, engines, tiny_model: str,
                                                   tmp_path: Path) -> None:
    """Scenario: an instance serves P1 with LoRA adapter "ad" from a path and saves its blocks.
    The adapter at that path is then replaced by other weights (same name, same path: vLLM's block
    hashes are the same). A fresh instance with the new adapter must not load the old adapter's
    blocks (and its output differs: the adapter matters); it then loads its own."""
    adapter = tmp_path / "adapter"
    write_adapter(adapter, tiny_model, seed=1)
    lora = {"enable_lora": True, "max_lora_rank": 8}
    step = {"generate": [P1], "max_tokens": MAX_TOKENS, "lora": ["ad", 1, str(adapter)]}
    kv = pool.kv_transfer_config(cache_prefix="lora-test")
    old = engines("lora_old", [step], kv, **lora).result()["steps"][0][0]
    assert old["num_cached_tokens"] == 0
    write_adapter(adapter, tiny_model, seed=2)
    ready, go = tmp_path / "ready", tmp_path / "go"
    e = engines("lora_new", [step, {"signal_file": str(ready)}, {"wait_for_file": str(go)}, step],
                kv, **lora)
    release_when_saved(pool, e, ready, go, lambda keys: sum(
        k.startswith("mc@lora-test@") for k in keys) >= 2 * P1_BLOCKS)
    new = e.result()
    first, again = new["steps"][0][0], new["steps"][3][0]
    assert first["num_cached_tokens"] == 0, "blocks of the adapter's old contents were loaded"
    assert first["token_ids"] != old["token_ids"], "the adapter's contents change the output"
    assert again["num_cached_tokens"] == full_hit(P1)
    assert again["token_ids"] == first["token_ids"]
