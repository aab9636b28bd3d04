"""Fixtures for the vLLM engine tests: a tiny local model, a live pool, engine lifetimes.

Run with the vLLM test environment's python (``.ci/vllm_env.sh`` prints it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    BLOCK,
    CROWD,
    CROWD_MAX_TOKENS,
    MAX_TOKENS,
    PROMPTS,
    Engine,
    Pool,
    engine_spec,
    make_model,
)

from memcache_core.testing import running_meta_service, started

if importlib.util.find_spec("vllm") is None:
    # Not the vLLM test environment (.ci/vllm_env.sh): nothing here can run.
    collect_ignore_glob = ["test_*.py"]


# Engine lifetimes per module, roughly what a module costs. CI runs this suite two modules at a
# time (pytest-xdist: ``-n 2 --dist loadfile --no-loadscope-reorder``, modules handed out in this
# order rather than by their number of tests): the costliest first, so that neither worker is left
# with a long module at the end. A module not listed counts as two lifetimes.
MODULE_ENGINES = {"test_pool_integrity.py": 17, "test_memcache_connector.py": 9,
                  "test_default_deployment.py": 8, "test_tensor_parallel.py": 8, "test_layerwise.py": 6,
                  "test_disk_tier.py": 2, "test_kv_routing.py": 6,
                  "test_openai_server.py": 2, "test_connector_parts.py": 0, "test_kv_events_vllm.py": 0}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -MODULE_ENGINES.get(item.path.name, 2))  # stable: a module keeps its order


@pytest.fixture(scope="session", autouse=True)
def private_shm_dir() -> Iterator[None]:
    """The pools of this session keep their segments in a directory of their own, so that a
    LocalService of another build starting on the same host (whose stale-segment cleanup may judge
    liveness differently) never unlinks them. Inherited by every process the tests start."""
    if "MEMCACHE_SHM_DIR" in os.environ or not Path("/dev/shm").is_dir():
        yield
        return
    path = Path("/dev/shm") / f"vllm-engine-tests-{os.getpid()}"
    path.mkdir(exist_ok=True)
    os.environ["MEMCACHE_SHM_DIR"] = str(path)
    try:
        yield
    finally:
        del os.environ["MEMCACHE_SHM_DIR"]
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return make_model("tests", "2", "256", "4", "2")


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with running_meta_service() as meta:
        p = Pool(meta, tmp_path_factory.mktemp("pool"))
        try:
            p.start_local_service()
            yield p
        finally:
            p.stop()


@pytest.fixture
def engines(tmp_path: Path, tiny_model: str) -> Iterator[Callable[..., Engine]]:
    def engine(name: str, steps: list[dict[str, Any]], kv: dict[str, Any] | None = None,
               **spec: Any) -> Engine:
        return Engine(engine_spec(tiny_model, BLOCK, steps, kv, **spec), tmp_path, name)

    with started(engine, Engine.kill) as start:
        yield start


@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory, tiny_model: str) -> dict[str, dict[str, Any]]:
    """What vLLM produces for every prompt without a connector."""
    names = list(PROMPTS)
    spec = {"model": tiny_model, "block_size": BLOCK, "kv_transfer_config": None,
            "steps": [{"generate": [PROMPTS[n] for n in names], "max_tokens": MAX_TOKENS},
                      {"generate": CROWD, "max_tokens": CROWD_MAX_TOKENS}]}
    res = Engine(spec, tmp_path_factory.mktemp("baseline"), "baseline").result()
    out = dict(zip(names, res["steps"][0], strict=True))
    out.update({f"crowd{i}": r for i, r in enumerate(res["steps"][1])})
    return out
