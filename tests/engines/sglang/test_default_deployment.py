"""The default deployment: every server's store holds its own segment (no standalone provider).

Two servers seeded alike (``--random-seed``, so Python's ``random`` draws the same numbers in both)
join one pool; the reader restores from L3 what the writer stored in *its* segment, and its
output must equal the writer's device-hit output. Shapes, page sizes and dtypes are covered
pairwise together with ``test_npu_memcache_backend.py::test_two_servers_share_one_pool`` (MHA,
page 128, bf16):

| case | attention | page | dtype |
|---|---|---|---|
| gqa_p128_fp16 | GQA (4 query heads, 2 KV heads) | 128 | float16 |
| gqa_p64_bf16 | GQA | 64 | bfloat16 |
| mha_p64_fp16 | MHA (4 heads) | 64 | float16 |

Writer and reader of a case start together, to keep the suite's time down; the reader joins the
pool once the writer's store has joined.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    PROMPT_TOKENS,
    generate,
    generate_from_storage,
    pool_keys,
    prompt,
    start,
    wait_for_new_keys,
)
from memcache_sglang import testing as harness

from memcache_core.testing import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


@dataclass(frozen=True)
class Case:
    kv_heads: int
    page: int
    dtype: str


CASES = {
    "gqa_p128_fp16": Case(kv_heads=2, page=128, dtype="float16"),
    "gqa_p64_bf16": Case(kv_heads=2, page=64, dtype="bfloat16"),
    "mha_p64_fp16": Case(kv_heads=4, page=64, dtype="float16"),
}


STORE_READY = "MemCache store ready"


def wait_for_log(path: Path, text: str, starting: Future, timeout_s: float = 300) -> None:
    """Wait until a starting server's log shows ``text`` (or its start fails: re-raise that)."""
    def logged() -> bool:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        if starting.done():
            starting.result()  # raises if the start failed
            return True
        return False

    wait_for(logged, timeout_s, f"{text!r} in {path}", interval_s=0.2)


@pytest.mark.parametrize("name", list(CASES))
def test_reader_restores_what_the_writer_holds(name: str, meta: harness.MetaHandle, tmp_path: Path) -> None:
    """Scenario: writer serves a prompt (pages written into its own segment) and stays up; a
    reader seeded like it restores the pages from the writer's segment -> the writer's
    device-hit output."""
    case = CASES[name]
    model = harness.ensure_model(sys.executable, ["--kv-heads", str(case.kv_heads)])
    args = ["--page-size", str(case.page), "--dtype", case.dtype]
    full_pages = PROMPT_TOKENS // case.page
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, meta, model, tmp_path, "writer", extra_args=args)]
        # The reader joins the pool after the writer: with ids drawn from a seeded generator it is
        # the reader that collides (and then read its own empty segment where the writer's was).
        wait_for_log(tmp_path / "writer.log", STORE_READY, futures[0])
        futures.append(pool.submit(start, meta, model, tmp_path, "reader", extra_args=args))
        servers = []
        for f in futures:
            try:
                servers.append(f.result())
            except Exception:
                for s in servers:
                    s.stop()
                raise
    writer, reader = servers
    try:
        ids = prompt(50 + list(CASES).index(name))
        before = pool_keys(meta)
        cold = generate(writer, ids)
        assert cold["storage"] == cold["device"] == 0, cold
        written = wait_for_new_keys(meta, before, full_pages)
        assert len(written) == full_pages, len(written)  # one object per page shard, all in the writer's segment
        warm = generate(writer, ids)
        assert warm["device"] >= (full_pages - 1) * case.page and warm["storage"] == 0, warm

        got = generate_from_storage(reader, ids, full_pages, case.page)
        assert got["text"] == warm["text"], (got, warm)
    finally:
        writer.stop()
        reader.stop()
