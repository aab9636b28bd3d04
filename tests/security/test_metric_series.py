"""/metrics against an insider that joins with many segments: the per-segment series are capped."""

from __future__ import annotations

import os
import re
import secrets

import pytest

from memcache_core import DistributedObjectStore
from memcache_core import protocol as p
from memcache_core.meta.stats import MAX_SEGMENT_SERIES
from memcache_core.testing import running_meta_service
from tests.security.wire import addr_of, ask, authed

pytestmark = pytest.mark.integration


def test_segments_joined_by_an_insider_do_not_grow_the_metrics_without_bound():
    """Scenario: before, every segment had its own series in five families (and disk tiers in four):
    an insider joining thousands of 4 KiB segments grew every scrape with them. Now the
    MAX_SEGMENT_SERIES largest segments have series, the rest are counted in
    memcache_segments_unlisted, the pool's totals count them all, and an honest provider's segment
    (larger than the insider's) stays listed."""
    extra = MAX_SEGMENT_SERIES + 50
    with running_meta_service(heartbeat_timeout_ms=120_000) as meta:
        store = DistributedObjectStore()
        assert store.setup(meta.local_config(dram_size="64MB")) == 0
        assert store.init(0, True) == 0
        s = authed(addr_of(meta.meta_service_url))
        try:
            for i in range(extra):
                seg = p.SegmentInfo(0, 4096, f"insider-{i}", f"/dev/shm/memcache-{os.getpid()}-{secrets.token_hex(8)}",
                                    "127.0.0.1:9")
                assert isinstance(ask(s, p.Join(0, f"insider-{i}", os.getpid(), seg)), p.Joined)
            text = meta.http("/metrics")
            series = re.findall(r'^memcache_segment_capacity_bytes\{host="([^"]*)",segment="[^"]*"', text, re.M)
            assert len(series) == MAX_SEGMENT_SERIES, len(series)
            assert [h for h in series if not h.startswith("insider-")], "the honest provider's segment is not listed"
            assert meta.metric("segments_unlisted") == extra + 1 - MAX_SEGMENT_SERIES
            assert meta.metric("pool_capacity_bytes") == (64 << 20) + extra * 4096
            assert len(re.findall(r"^memcache_segment_allocated_bytes\{", text, re.M)) == MAX_SEGMENT_SERIES
        finally:
            s.close()
            store.close()
