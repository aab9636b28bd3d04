"""An engine-held segment after its server restarts (the default deployment, restarted quicker than
the MetaService's ``heartbeat_timeout_ms``).

SGLang's shutdown ends the scheduler by a signal: its store never sends ``Leave``, and the
MetaService keeps listing the dead segment and its objects until the heartbeat timeout. The pages in
that segment died with the engine, so the restarted server's first request misses; what it computes
must be written to the pool and the same prompt, returning, must come from L3. While the dead
segment is listed, the restarted server's ``exist`` answers yes for its pages, the reads of them
fail (a miss every time the prompt returns) and its write-through of the recomputed pages is a
no-op (putting an existing key is a success), until the timeout drops them.

The test's MetaService declares a member dead after 120 s, so that this slow machine's restart
(about 30 s) happens within it, as a restart on a production host does within the default 10 s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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

from memcache_core.testing import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

HEARTBEAT_TIMEOUT_MS = 120_000
DEAD_SEGMENT_GONE_S = 30.0   # far below the heartbeat timeout: the owner is known dead at once
WRITE_THROUGH_S = 60.0


def segments(meta: harness.MetaHandle) -> list[dict[str, Any]]:
    return list(meta.admin("/get_all_segments")["segments"])


def live(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def test_a_restarted_server_stores_and_restores_what_it_computes(model: str, tmp_path: Path) -> None:
    """Scenario: a server with its own segment serves a prompt, is stopped and started again within
    the heartbeat timeout -> the dead segment leaves the pool at once, the first request (a miss:
    its pages died with the engine) is written through, and the prompt returning after a flush
    comes from L3 no slower than a later returning prompt."""
    ids = [prompt(800 + i) for i in range(2)]
    meta = harness.start_meta(tmp_path / "meta", heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    try:
        before = pool_keys(meta)
        first = start(meta, model, tmp_path, "before_restart")
        try:
            generate(first, ids[0])
            wait_for_new_keys(meta, before, FULL_PAGES)
        finally:
            first.stop()
        dead = [s for s in segments(meta) if not live(s["pid"])]
        assert dead and dead[0]["objects"] >= FULL_PAGES, segments(meta)   # the premise: still listed

        second = start(meta, model, tmp_path, "after_restart")
        try:
            wait_for(lambda: not any(s["segment_id"] == dead[0]["segment_id"] for s in segments(meta)),
                     DEAD_SEGMENT_GONE_S, lambda: f"the dead server's segment to leave the pool: {segments(meta)}",
                     interval_s=0.5)
            restored = []
            for prompt_ids in ids:
                before = pool_keys(meta)
                cold = generate(second, prompt_ids)
                assert cold["storage"] == 0, cold   # nothing of it survives: its pages died with the engine
                wait_for_new_keys(meta, before, FULL_PAGES, timeout_s=WRITE_THROUGH_S)
                flush(second)
                restored.append(generate_from_storage(second, prompt_ids))
                assert restored[-1]["text"] == cold["text"]
        finally:
            second.stop()
    finally:
        meta.stop()
    assert restored[0]["seconds"] <= restored[1]["seconds"] + 3.0, restored
