"""Shared pieces of the vLLM engine tests: prompts, the pool, engine lifetimes, comparisons.

Every engine lifetime is a fresh process (``llm_runner.py``); the pool is a real MetaService plus a
standalone LocalService holding the blocks, so they outlive the engines that saved them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memcache_core.testing import (
    die_with_parent,
    running_meta_service,
    start_local_service,
    started,
    wait_for,
)

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
RUNNER = HERE / "llm_runner.py"
BLOCK = 32
ENGINE_TIMEOUT_S = 420
# The layer-wise tests' tiny Llamas (layers, hidden, heads, KV heads): GQA (2 KV heads, one per rank
# at TP 2) and MHA (4 KV heads, two per rank at TP 2).
SHAPES = {"gqa": ("2", "256", "4", "2"), "mha": ("2", "256", "4", "4")}


def make_model(name: str, layers: str, hidden: str, heads: str, kv_heads: str) -> str:
    """A tiny random Llama (examples/make_tiny_model.py), cached by name; returns its directory."""
    out = Path(os.environ.get("MEMCACHE_CACHE_DIR", Path.home() / ".cache" / "memcache")) \
        / "models" / f"tiny-llama-vllm-{name}"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--out", str(out),
         "--layers", layers, "--hidden", hidden, "--heads", heads, "--kv-heads", kv_heads],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def all_shapes(*cases: tuple[str, int]) -> list[Any]:
    """``cases`` as parameters that run only with ``MEMCACHE_ENGINE_ALL_SHAPES=1`` (each one more
    engine start: the rest of the cross product of the layer-wise shapes beyond CI's pairwise cover)."""
    skip = pytest.mark.skipif(not os.environ.get("MEMCACHE_ENGINE_ALL_SHAPES"),
                              reason="set MEMCACHE_ENGINE_ALL_SHAPES=1 to run")
    return [pytest.param(*case, marks=skip) for case in cases]


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / "integrations"), str(HERE), str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    return env


def tokens(n: int, seed: int) -> list[int]:
    """A deterministic prompt of ``n`` token ids (no special tokens)."""
    return [(i * 7919 + seed * 104729) % 31000 + 10 for i in range(n)]


P1 = tokens(300, 1)
P2 = P1 + tokens(150, 2)       # shares P1's 9 full blocks
P3 = tokens(260, 3)
P4 = tokens(230, 4)
P5 = P1 + tokens(150, 5)       # shares P1's blocks, not P2's
PROMPTS = {"P1": P1, "P2": P2, "P3": P3, "P4": P4, "P5": P5}
# Three requests (10 blocks each at admission) that grow to 15 blocks each while decoding, in a
# 36-block KV cache: vLLM must preempt.
CROWD = [tokens(300, 10 + i) for i in range(3)]
CROWD_MAX_TOKENS = 160
CROWD_BLOCKS = 36
MAX_TOKENS = 8


def full_hit(prompt: list[int]) -> int:
    """Tokens vLLM can take from outside: whole blocks, never the last prompt token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


class Pool:
    """A MetaService and a standalone LocalService (the memory that outlives engines)."""

    def __init__(self, meta: Any, workdir: Path) -> None:
        self.meta = meta
        self.workdir = workdir
        self.local: subprocess.Popen | None = None

    def start_local_service(self, dram: str = "512MB", **extra: Any) -> None:
        """``extra``: more LocalConfig keys of the provider (a disk tier: ``disk_path``, ...)."""
        config = {"meta_service_url": self.meta.meta_service_url, "config_store_url": self.meta.config_store_url,
                  "protocol": "host_shm", "dram_size": dram, **extra}
        self.local, _ = start_local_service(config, self.workdir,
                                            lambda: self.meta.http("/get_all_segments").get("segments", []),
                                            name="local_service", env=engine_env())

    def stop(self) -> None:
        if self.local is not None and self.local.poll() is None:
            self.local.terminate()
            try:
                self.local.wait(10)
            except subprocess.TimeoutExpired:
                self.local.kill()
                self.local.wait()

    def keys(self) -> list[str]:
        return list(self.meta.http("/get_all_keys").get("keys", []))

    def restart_meta(self, keys: int) -> None:
        """Start the stopped MetaService again and wait until the pool is as it was: the provider
        re-joined and reported its ``keys`` objects, and its segment takes new objects again (a
        re-joined segment waits out one lease TTL first: reads leased before the restart may run)."""
        self.meta.start()
        wait_for(lambda: len(self.keys()) >= keys, 30, "the provider to re-join with its objects", interval_s=0.2)
        wait_for(lambda: all(s["accepts_new_objects"] for s in self.meta.http("/get_all_segments")["segments"]),
                 30, "the re-joined segment to take new objects again", interval_s=0.2)

    def kv_transfer_config(self, **extra: Any) -> dict[str, Any]:
        connector_extra = {"meta_service_url": self.meta.meta_service_url,
                           "config_store_url": self.meta.config_store_url,
                           "protocol": "host_shm", "dram_size": "0"}
        module = extra.pop("module", "memcache_vllm")
        connector_extra.update(extra)
        return {"kv_connector": "MemCacheConnector", "kv_connector_module_path": module,
                "kv_role": connector_extra.pop("kv_role", "kv_both"),   # no kv_load_failure_policy: the
                "kv_connector_extra_config": connector_extra}           # connector makes it "recompute"


class Engine:
    """One engine lifetime in a fresh process; ``result()`` waits for it."""

    def __init__(self, spec: dict[str, Any], workdir: Path, name: str) -> None:
        self.name = name
        self.out = workdir / f"{name}.out.json"
        self.log = workdir / f"{name}.log"
        spec_path = workdir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        self.proc = subprocess.Popen([sys.executable, str(RUNNER), str(spec_path), str(self.out)],
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env=engine_env(), preexec_fn=die_with_parent())

    def result(self, timeout_s: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} timed out:\n{self.log.read_text()[-4000:]}") from None
        assert rc == 0, f"{self.name} exited {rc}:\n{self.log.read_text()[-4000:]}"
        return json.loads(self.out.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def engine_spec(model: str, block: int, steps: list[dict[str, Any]], kv: dict[str, Any] | None, /,
                **spec: Any) -> dict[str, Any]:
    """What one engine lifetime runs (``llm_runner.py``): ``model`` with ``block``-token blocks, its
    ``steps``, the connector's ``kv_transfer_config`` (None: no connector), vLLM's prefix cache off
    unless ``spec`` turns it on; ``spec`` adds or overrides any key, ``model`` included (the first
    four are positional only, so ``model=`` in ``spec`` is an override, not a second value)."""
    return {"model": model, "block_size": block, "steps": steps, "kv_transfer_config": kv,
            "enable_prefix_caching": False, **spec}


@contextlib.contextmanager
def own_pool(workdir: Path, dram: str = "256MB") -> Iterator[tuple[Pool, Callable[[str, dict[str, Any]], Engine]]]:
    """A pool of the test's own (a MetaService and a standalone ``dram`` provider) and
    ``start(name, spec)``, which starts an engine lifetime in ``workdir``. On exit every engine
    started is killed, then the pool stopped."""
    with running_meta_service() as meta:
        pool = Pool(meta, workdir)
        try:
            pool.start_local_service(dram)
            with started(lambda name, spec: Engine(spec, workdir, name), Engine.kill) as start:
                yield pool, start
        finally:
            pool.stop()


def metric(res: dict[str, Any], name: str) -> float:
    """An engine's vLLM metric ``name`` (a counter may carry the ``_total`` suffix), 0 if absent."""
    m = res["metrics"]
    return m.get(f"vllm:{name}", m.get(f"vllm:{name}_total", 0.0))


# Logprobs of one prompt computed in other shapes (alone against a batch, a prefill over cached blocks
# against a cold one) differ in their last digits on hosts whose CPU kernels are not batch-invariant:
# seen on a Xeon with AMX, 2e-4 between vLLM's own prefix-cache hit and its cold computation, 0.03 for
# a prompt run alone against the batched baseline. Wrong KV (stale, another rank's, garbage) changes
# the tokens and moves logprobs by far more.
ACROSS_SHAPES_ABS = 0.05


def assert_same_output(got: dict[str, Any], want: dict[str, Any], what: str, *, across_shapes: bool = False) -> None:
    """The same tokens, and logprobs equal to 1e-6 (to ``ACROSS_SHAPES_ABS`` where ``got`` and ``want``
    were computed in other shapes)."""
    assert got["token_ids"] == want["token_ids"], f"{what}: tokens differ from the baseline"
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=ACROSS_SHAPES_ABS if across_shapes else 1e-6), \
        f"{what}: logprobs differ from the baseline"


def write_adapter(path: Path, model: str, seed: int) -> None:
    """A rank-8 LoRA adapter on v_proj (it changes the V cache) of the tiny model, PEFT format."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(model) / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    v_out = cfg["num_key_value_heads"] * (hidden // cfg["num_attention_heads"])
    gen_ = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        base = f"base_model.model.model.layers.{i}.self_attn.v_proj"
        tensors[f"{base}.lora_A.weight"] = torch.randn(8, hidden, generator=gen_) * 0.2
        tensors[f"{base}.lora_B.weight"] = torch.randn(v_out, 8, generator=gen_) * 0.2
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16,
        "lora_dropout": 0.0, "target_modules": ["v_proj"], "bias": "none",
        "base_model_name_or_path": model, "fan_in_fan_out": False, "modules_to_save": None}))
