"""Per-key outcomes of batch requests (``memcache_outcomes_total``), counted once per distinct code."""

from __future__ import annotations

import collections

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.meta.stats import code_name, count_outcomes


def test_a_batch_counts_each_key_once_under_its_code():
    codes = [0] * 7 + [errors.OUT_OF_MEMORY] * 2 + [errors.WRITE_IN_PROGRESS]
    out: collections.Counter[tuple[str, str]] = collections.Counter()
    count_outcomes(out, p.Alloc(1, b"", ["k"] * 10, [1] * 10), p.AllocReply([p.AllocResult(c) for c in codes]))
    count_outcomes(out, p.Commit(1, b"", ["k"] * 10, [1] * 10), p.Codes(codes))
    count_outcomes(out, p.Remove(["k"] * 10), p.Codes(codes[::-1]))
    count_outcomes(out, p.Lookup(["k"] * 3), p.LookupReply([None, p.Found(1, 1, []), None]))
    count_outcomes(out, p.Exist(["k"] * 3), p.Flags([True, False, True]))
    for op in ("put", "commit", "remove"):
        assert out[op, code_name(0)] == 7 and out[op, code_name(errors.OUT_OF_MEMORY)] == 2
        assert out[op, code_name(errors.WRITE_IN_PROGRESS)] == 1
    assert out["get", "hit"] == 1 and out["get", "miss"] == 2
    assert out["exist", "found"] == 2 and out["exist", "missing"] == 1
    assert sum(out.values()) == 3 * 10 + 3 + 3
