"""A writer that holds a segment's write fence (frozen mid-copy, or any process of the host taking a
shared lock on the fence page) does not keep the segment's owner out of the pool after a MetaService
restart (docs/design.md, "Failure of the MetaService": a held segment; ``memcache_core/fence.py``).

The owner waits ``fence_wait_ms`` for the writes in flight to end, then re-joins with its segment
*held*: its committed objects are served, but nothing new is placed in it until the lock is had. To
show that the hold is what keeps it safe, the "insider" writes garbage over every byte of the segment
that is not a reported object's while it holds the lock: every committed object still reads back
byte-exact. Once it lets go, the hold ends within a few heartbeats and puts land in the segment again.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from memcache_core.layout import footprint
from memcache_core.testing import die_with_parent, free_port, scrape_metrics, wait_for
from tests.integration.stores import answers_again

pytestmark = pytest.mark.integration

LAYOUT = [64 << 10] * 4          # 256 KiB objects
FENCE_WAIT_MS = 1000
KEYS = [f"held-{i}" for i in range(12)]

# The insider: takes a shared OFD lock on the fence page (as a writer does), then on each stdin line
# ``[[offset, length], ...]`` writes garbage over those ranges of the segment file; "release" drops the lock.
INSIDER = r"""
import fcntl, json, os, sys
from memcache_core.fence import _lock
path, start = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR)
assert _lock(fd, fcntl.F_RDLCK, start, wait=False)
print("locked", flush=True)
for line in sys.stdin:
    if line.strip() == "release":
        _lock(fd, fcntl.F_UNLCK, start, wait=False)
        print("released", flush=True)
        continue
    for off, n in json.loads(line):
        junk = bytes([0x5A]) * min(n, 1 << 20)
        while n > 0:
            k = os.pwrite(fd, junk[:min(n, len(junk))], off)
            off, n = off + k, n - k
    print("written", flush=True)
"""


def segments(meta) -> dict[int, dict]:
    return {s["segment_id"]: s for s in meta.http("/get_all_segments")["segments"]}


def where(meta, key: str) -> list[tuple[int, int]]:
    return [(int(loc["segment"]), int(loc["offset"])) for loc in meta.http(f"/query_key?key={key}")["locations"]]


def free_ranges(size: int, taken: list[tuple[int, int]]) -> list[list[int]]:
    """The ranges of [0, size) outside every (offset, length) of ``taken``."""
    out, at = [], 0
    for off, n in sorted(taken):
        if off > at:
            out.append([at, off - at])
        at = max(at, off + n)
    if at < size:
        out.append([at, size - at])
    return out


def held_as_operators_see_it(meta, segment_id: int, metrics_port: int) -> tuple[float, str, bool]:
    """The provider's own ``memcache_local_segment_held``, the state ``memcache status`` prints beside the
    segment's tier, and whether the status page's state column says ``held``."""
    gauge = scrape_metrics(metrics_port, meta.admin_headers())["memcache_local_segment_held"]
    out = subprocess.run([sys.executable, "-m", "memcache_core.cli", "status", "--url", meta.metrics_url],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "220"})
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.split("│")[1:2] == [f" {segment_id} "]
               or line.lstrip("│ ").startswith(f"{segment_id} "))
    page = urllib.request.urlopen(urllib.request.Request(meta.metrics_url + "/status", headers=meta.admin_headers()),
                                  timeout=30).read().decode()
    mine = page.split('<tr class="segment" data-used=')[1:]
    cells = next(r for r in mine if f"<td>{segment_id}</td>" in r.split("</tr>")[0])
    return gauge, row, "<td>held</td>" in cells.split("</tr>")[0]


def test_a_held_fence_delays_no_rejoin_and_the_hold_keeps_the_segment_safe(meta, stores):
    p_port = free_port()
    p_store = stores(dram_size="32MB", fence_wait_ms=FENCE_WAIT_MS, metrics_port=p_port)
    stores(dram_size="32MB")                     # Q: where puts go while P is held
    writer = stores(init_bm=False)
    p_id = p_store("id")["id"]
    assert writer("put", keys=KEYS, layout=LAYOUT, preferred=[p_id])["codes"] == [0] * len(KEYS)
    assert all(where(meta, k) == [(p_id, where(meta, k)[0][1])] for k in KEYS)
    got = writer("get", keys=KEYS, layout=LAYOUT)
    assert got["codes"] == [0] * len(KEYS) and got["mismatches"] == []
    info = meta.segment(p_id)
    insider = subprocess.Popen([sys.executable, "-c", INSIDER, info.shm_path, str(info.size)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, bufsize=1, preexec_fn=die_with_parent())
    try:
        assert insider.stdout is not None and insider.stdin is not None
        assert insider.stdout.readline().strip() == "locked"

        meta.kill()
        meta.start()
        t0 = time.monotonic()
        wait_for(lambda: p_id in segments(meta) and len(segments(meta)) == 2, FENCE_WAIT_MS / 1000 + 6,
                 "the provider whose fence a writer holds to re-join")
        rejoined_s = time.monotonic() - t0
        assert segments(meta)[p_id]["held"] is True and not segments(meta)[p_id]["accepts_new_objects"]
        wait_for(functools.partial(answers_again, writer, KEYS[0]), 20, "the writer to reach the new MetaService")
        got = writer("get", keys=KEYS, layout=LAYOUT)
        assert got["codes"] == [0] * len(KEYS) and got["mismatches"] == []

        # nothing new goes into the held segment, even when the writer asks for it
        new = [f"while-held-{i}" for i in range(8)]
        assert writer("put", keys=new, layout=LAYOUT, preferred=[p_id])["codes"] == [0] * len(new)
        assert all(sid != p_id for k in new for sid, _ in where(meta, k))

        # the insider writes garbage over every byte of P's space that no reported object holds
        objects = [(off, footprint(sum(LAYOUT))) for k in KEYS for _, off in where(meta, k)]
        insider.stdin.write(json.dumps(free_ranges(info.size, objects)) + "\n")
        assert insider.stdout.readline().strip() == "written"
        got = writer("get", keys=KEYS, layout=LAYOUT)
        assert got["codes"] == [0] * len(KEYS) and got["mismatches"] == []
        assert segments(meta)[p_id]["held"] is True
        assert meta.metric("held_segments") == 1
        gauge, row, on_page = held_as_operators_see_it(meta, p_id, p_port)
        assert gauge == 1 and "(held)" in row and on_page, row

        insider.stdin.write("release\n")
        assert insider.stdout.readline().strip() == "released"
        wait_for(lambda: segments(meta)[p_id]["held"] is False, 5, "the hold to end once the lock is let go")
        # (and the grace of a re-joined segment with objects, lease_ttl_ms, is over)
        wait_for(lambda: segments(meta)[p_id]["accepts_new_objects"], 5, "P to take new objects again")
        after = [f"after-hold-{i}" for i in range(4)]
        assert writer("put", keys=after, layout=LAYOUT, preferred=[p_id])["codes"] == [0] * len(after)
        assert all(where(meta, k)[0][0] == p_id for k in after)
        got = writer("get", keys=KEYS + new + after, layout=LAYOUT)
        assert got["codes"] == [0] * len(got["codes"]) and got["mismatches"] == []
        assert meta.metric("held_segments") == 0
        gauge, row, on_page = held_as_operators_see_it(meta, p_id, p_port)
        assert gauge == 0 and "(held)" not in row and not on_page, row
        print(f"re-joined {rejoined_s:.2f} s after the restart (fence_wait_ms {FENCE_WAIT_MS})")
    finally:
        insider.kill()
        insider.wait()
