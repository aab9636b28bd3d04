"""The pieces of ``meta/replay.py`` that need no socket: the window of kept batches a replay reads
while the publisher adds to it, and the token bucket behind the rate bounds (time is a parameter)."""

from __future__ import annotations

import pytest

from memcache_core.meta.replay import Bucket, KeptBatches


def window(steps: int, n: int) -> KeptBatches:
    kept = KeptBatches(steps)
    for seq in range(n):
        kept.append(seq, b"b%d" % seq)
    return kept


@pytest.mark.parametrize(("seq", "end", "limit", "want"), [
    (0, 5, 10, [3, 4, 5]),     # asked from before the window: from its oldest batch
    (4, 5, 1, [4]),            # a turn is at most `limit` batches
    (3, 4, 10, [3, 4]),        # never past the last batch kept when the replay was asked for
    (0, 2, 10, []),            # everything it was to send left the window: nothing, then the end
    (6, 5, 10, []),            # from past the last batch: nothing
])
def test_a_replay_reads_the_kept_window(seq, end, limit, want):
    """Scenario: 6 batches published, 3 kept; a replay reads its range, clipped to the window."""
    kept = window(3, 6)
    assert kept.last() == 5
    assert kept.since(seq, end, limit) == [(q, b"b%d" % q) for q in want]


def test_the_window_keeps_only_the_last_steps_batches():
    kept = window(1000, 5000)
    assert [q for q, _ in kept.since(0, 10_000, 10_000)] == list(range(4000, 5000))
    assert len(kept._batches) == 1000
    assert KeptBatches(10).since(0, -1, 10) == [] and KeptBatches(10).last() == -1


def test_the_bucket_holds_one_seconds_worth_and_may_go_into_debt():
    """Scenario: 100 a second: full at the start, capped at 100 however long it rests; a batch larger
    than what is left takes it below zero, and the wait until it holds 1 again says so."""
    b = Bucket(100, now=0.0)
    assert b.tokens == 100
    b.refill(60.0)
    assert b.tokens == 100
    b.tokens -= 150
    assert b.wait_s(1) == pytest.approx(0.51)
    b.refill(60.25)
    assert b.tokens == pytest.approx(-25)
    b.refill(61.0)
    assert b.tokens == pytest.approx(50) and b.wait_s(1) == 0
