"""Other host layouts and parallel shapes through real SGLang servers sharing one pool.

A ``page_head`` server at TP 1 with ``tp_lcm_size`` 2 (the writer) stays up for the whole module:
SGLang splits each page's heads in two (``should_split_heads``) and the backend stores one object
per head group, keyed by the head-group rank a TP-2 server uses. While it holds its objects (they
live in its own memory), other servers start one at a time:

* ``page_head`` at TP 2 with ``tp_lcm_size`` 2: two scheduler processes (two LocalServices); each
  rank restores the head-group objects the TP-1 writer stored;
* ``page_first`` (kernel IO) and ``--hicache-storage-backend dynamic`` without ``interface_v1``
  (``layer_first`` host layout, SGLang's generic copy path: the legacy
  ``batch_get``/``batch_set``/``batch_exists`` calls with whole flat pages) must not hit the
  writer's objects (other bytes -> other namespace).
Each one also restores its own writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import (
    FULL_PAGES,
    flush,
    generate,
    generate_from_storage,
    pool_keys,
    prompt,
    start,
    wait_for_new_keys,
)
from memcache_sglang import testing as harness

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

KERNEL_IO = ["--hicache-io-backend", "kernel"]
PAGE_HEAD = ["--hicache-mem-layout", "page_head", *KERNEL_IO]
WRITER_PROMPT = prompt(21)


@dataclass
class Case:
    extra: dict
    args: list[str]
    objects_per_page: int  # written per page by the whole server
    reads_writer: bool  # True: must restore the writer's pages; False: must not hit them
    shards: set[str] = field(default_factory=set)
    env: dict[str, str] = field(default_factory=dict)


CASES = {
    "page_head_tp2": Case({"tp_lcm_size": 2}, [*PAGE_HEAD, "--tp-size", "2"], 2, True, {"r0p0c0", "r1p0c0"},
                          {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}),
    "page_first": Case({}, ["--hicache-mem-layout", "page_first", *KERNEL_IO], 1, False),
    "dynamic_copy_path": Case({"backend_name": "memcache", "module_path": "memcache_sglang.hicache_backend",
                               "class_name": "NpuMemcacheStore"},
                              ["--hicache-storage-backend", "dynamic", "--hicache-mem-layout", "layer_first"],
                              1, False),
}


def round_trip(server: harness.ServerHandle, meta: harness.MetaHandle, ids: list[int],
               objects_per_page: int) -> tuple[dict, set[str]]:
    """Cold request, write-through, /flush_cache, restore from L3 with the same text."""
    before = pool_keys(meta)
    cold = generate(server, ids)
    assert cold["storage"] == 0 and cold["device"] == 0, cold
    new = wait_for_new_keys(meta, before, objects_per_page * FULL_PAGES)
    flush(server)
    restored = generate_from_storage(server, ids)
    assert restored["text"] == cold["text"]
    return cold, new


@pytest.fixture(scope="module")
def writer(meta: harness.MetaHandle, model: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[harness.ServerHandle, dict]]:
    server = start(meta, model, tmp_path_factory.mktemp("writer"), "writer", extra_config={"tp_lcm_size": 2},
                   extra_args=PAGE_HEAD)
    try:
        log = Path(server.log_path).read_text()
        assert "2 object(s) per page" in log and "head_sharding='hs2'" in log
        cold, new = round_trip(server, meta, WRITER_PROMPT, 2)
        assert {k.rsplit(".", 1)[-1] for k in new} == {"r0p0c0", "r1p0c0"}
        yield server, cold
    finally:
        server.stop()


@pytest.mark.parametrize("name", list(CASES))
def test_layout(name: str, writer: tuple, meta: harness.MetaHandle, model: str, tmp_path: Path) -> None:
    """Scenario: a layout restores its own writes; it shares objects only with byte-identical layouts."""
    case = CASES[name]
    _, written = writer
    server = start(meta, model, tmp_path, name, extra_config=case.extra, extra_args=case.args, env=case.env)
    try:
        log = Path(server.log_path).read_text()
        assert "memcache_sglang.hicache_backend" in log
        if case.reads_writer:
            # Same head groups, same bytes, same keys: each TP-2 rank reads one TP-1 head group.
            got = generate_from_storage(server, WRITER_PROMPT)
            # TP-2 arithmetic differs from TP-1 in the last bits: compare the first token only.
            assert got["text"].split()[0] == written["text"].split()[0], (got, written)
        else:
            got = generate(server, WRITER_PROMPT)
            assert got["storage"] == 0, f"{name} hit objects written under another layout: {got}"
        _, new = round_trip(server, meta, prompt(30 + list(CASES).index(name)), case.objects_per_page)
        if case.shards:
            assert {k.rsplit(".", 1)[-1] for k in new} == case.shards
        if name == "dynamic_copy_path":
            assert all(k.endswith(".flat") for k in new), sorted(new)[:3]
    finally:
        server.stop()
