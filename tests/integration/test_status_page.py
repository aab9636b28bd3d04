"""The status page in a real headless browser (Debian's Chromium), against a running pool."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import msgspec
import pytest

from memcache_core import DistributedObjectStore, ReplicateConfig
from memcache_core.auth import admin_token, load_secret
from memcache_core.meta import status_page
from memcache_core.meta.stats import DiskTierStats, Snapshot
from memcache_core.testing import MetaServiceProcess, running_meta_service, wait_for

pytestmark = pytest.mark.integration

ARTIFACTS = os.environ.get("MEMCACHE_TEST_ARTIFACTS",
                           os.path.join(os.path.dirname(__file__), "..", "..", "test-artifacts"))


def chromium() -> str:
    """The browser binary; its absence fails the test (.ci/run installs it), never skips it."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no Chromium found: install Debian's chromium package (.ci/run does so as root)")


def browser(*args: str) -> str:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--user-data-dir=" + os.path.join(ARTIFACTS, ".chromium-profile"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{cmd}: {out.stderr[-2000:]}"
    return out.stdout


def test_status_page_shows_members_and_usage_in_a_browser():
    with running_meta_service(heartbeat_timeout_ms=10_000, stats_sample_interval_seconds=0.2) as meta:
        _load_in_browser(meta)


def _load_in_browser(meta: MetaServiceProcess) -> None:
    stores = [DistributedObjectStore() for _ in range(2)]
    for s in stores:
        assert s.setup(meta.local_config()) == 0 and s.init(0, True) == 0
    try:
        for i in range(20):
            assert stores[i % 2].put(f"status-{i}", bytes([i]) * 100_000) == 0
        assert stores[0].get("status-1")
        token = admin_token(load_secret(meta.config.get("auth_secret_path", "")))
        host = meta.metrics_url.split("://", 1)[1]
        url = f"http://memcache:{token}@{host}/status"
        os.makedirs(ARTIFACTS, exist_ok=True)
        t0 = time.monotonic()
        dom = browser("--dump-dom", url)
        assert dom.count('class="member"') == 2 and dom.count('class="segment"') == 2, dom[:3000]
        used = [int(part.split('"', 1)[0]) for part in dom.split('class="segment" data-used="')[1:]]
        assert len(used) == 2 and all(u > 0 for u in used), used
        assert 'id="objects">20<' in dom and 'id="members">2<' in dom
        def traffic_sampled() -> bool:   # gets (hits and a miss) while the chart's samples are taken
            for i in range(20):
                stores[1].get(f"status-{i}")
            stores[1].get("status-absent")
            return len(meta.http("/api/v1/stats")["history"]) >= 6
        wait_for(traffic_sampled, 20, "samples of live traffic for the chart")
        assert '<svg id="chart"' in browser("--dump-dom", url)
        shot = os.path.abspath(os.path.join(ARTIFACTS, "status_page.png"))
        browser("--screenshot=" + shot, "--window-size=1200,900", "--hide-scrollbars", url)
        assert os.path.getsize(shot) > 10_000
        print(f"\nstatus page screenshot: {shot} ({time.monotonic() - t0:.1f} s in the browser)")
    finally:
        for s in stores:
            s.close()


MEASURE = """<script>addEventListener("load", () => {
  const spans = [...document.querySelectorAll("#summary > span")];
  const header = document.querySelector("header");
  document.body.dataset.lines = new Set(spans.map(e => e.offsetTop)).size;
  document.body.dataset.overflow = header.scrollWidth > header.clientWidth ? "yes" : "no";
});</script>"""


def _page_at(html: str, path: str, width: int) -> str:
    """The DOM of ``html`` laid out by Chromium ``width`` px wide, with the header measured (the
    page itself has no scripts: the measuring one is added to this copy only)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(html.replace("</body>", MEASURE + "</body>"))
    return browser("--dump-dom", f"--window-size={width},900", "--virtual-time-budget=3000", "file://" + path)


def test_the_header_holds_on_one_line_and_the_tables_show_what_needs_an_operator(meta):
    """Scenario: a pool with an object short of replicas (2 asked, 1 segment); the page, laid out
    1,400 px wide, has its header on one line (11 figures, none hidden), shows the under-replicated
    count; the same snapshot with a drain in progress and a disk tier that failed writes (as the
    MetaService reports them) shows both tables, with the errors."""
    s = DistributedObjectStore()
    assert s.setup(meta.local_config()) == 0 and s.init(0, True) == 0
    try:
        assert s.put("short", b"s" * 1000, ReplicateConfig(replicaNum=2)) == 0
        wait_for(lambda: meta.metric("objects_under_replicated") == 1, 10, "the object to count as under-replicated")
        snap = msgspec.convert(meta.http("/api/v1/stats"), Snapshot)
        sid = snap.segments[0].segment_id
        snap.drains_in_progress = [{"segment_id": sid, "state": "draining", "reason": "admin", "elapsed_s": 3.0,
                                    "timeout_s": 60.0, "objects_left": 7, "moved_objects": 5, "moved_bytes": 5 << 20,
                                    "dropped_objects": 0, "dropped_bytes": 0, "failed_moves": 0}]
        snap.disk_tiers = [DiskTierStats(sid, "lru", 1 << 30, 1 << 29, 12, {"writes": 40, "write_errors": 3})]
        snap.counters["integrity_failures"] = 2
        snap.counters.update(evictions=987_654_321, lookups=10**9, hits=9 * 10**8)   # a big, busy pool
        snap.objects, snap.uptime_s = 123_456_789, 86_400 * 40
        snap.segments = [msgspec.structs.replace(g, capacity_bytes=1023 << 30, used_bytes=1000 << 30)
                         for g in snap.segments] * 999
        snap.members = snap.members * 999
        os.makedirs(ARTIFACTS, exist_ok=True)
        dom = _page_at(status_page.render(snap), os.path.join(ARTIFACTS, "status_page_1400.html"), 1400)
        assert 'data-lines="1"' in dom and 'data-overflow="no"' in dom, dom[:2000]
        assert 'id="under-replicated">1<' in dom and 'id="integrity-failures">2<' in dom and 'id="draining">1<' in dom
        assert dom.count('class="drain"') == 1 and "5.0 MiB" in dom
        assert dom.count('class="disk-tier"') == 1 and '<td class="warn">3</td>' in dom
        narrow = _page_at(status_page.render(snap), os.path.join(ARTIFACTS, "status_page_700.html"), 700)
        assert 'data-overflow="yes"' in narrow or 'data-lines="1"' not in narrow   # negative control: it measures
    finally:
        s.close()


def test_the_chart_has_axes_and_a_gap_where_the_pool_was_idle():
    """Scenario: gets, then a few samples with none, then gets again: the hit-ratio line is two
    lines with a gap, never one line across the idle time; both axes are labelled."""
    with running_meta_service(stats_sample_interval_seconds=0.2) as meta:
        s = DistributedObjectStore()
        assert s.setup(meta.local_config()) == 0 and s.init(0, True) == 0
        try:
            assert s.put("chart", b"c" * 1000) == 0

            def sampled_with(gets: bool, n: int) -> Callable[[], bool]:
                first = len(meta.http("/api/v1/stats")["history"])

                def done() -> bool:
                    if gets:
                        s.get("chart")
                    return len(meta.http("/api/v1/stats")["history"]) >= min(first + n, 60)
                return done
            wait_for(sampled_with(True, 4), 20, "samples with gets")
            wait_for(sampled_with(False, 4), 20, "samples without gets")
            wait_for(sampled_with(True, 4), 20, "samples with gets again")
            chart = status_page._chart(msgspec.convert(meta.http("/api/v1/stats"), Snapshot))
            assert chart.count('<polyline class="ratio"') >= 2, chart   # lines, not lone dots
            assert chart.count('class="rate"') >= 1 and ">now<" in chart and "%</text>" in chart and "/s</text>" in chart
        finally:
            s.close()


def test_runs_cut_the_line_at_missing_values_and_at_holes_in_time():
    pts = [(0.0, 0.5), (1.0, 0.6), (2.0, None), (3.0, 0.7), (4.0, 0.8), (9.0, 0.9), (10.0, 1.0)]
    assert status_page._runs(pts, 2.5) == [[(0.0, 0.5), (1.0, 0.6)], [(3.0, 0.7), (4.0, 0.8)], [(9.0, 0.9), (10.0, 1.0)]]
    assert status_page._runs([(0.0, None), (1.0, None)], 2.5) == []


def test_status_page_needs_the_token_and_root_redirects(meta):
    host = meta.metrics_url
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(host + "/status", timeout=5)
    assert e.value.code == 401 and "Basic" in e.value.headers["WWW-Authenticate"]
    bad = base64.b64encode(b"memcache:wrong").decode()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(host + "/status", headers={"Authorization": f"Basic {bad}"}),
                               timeout=5)
    assert e.value.code == 401
    token = admin_token(load_secret(meta.config.get("auth_secret_path", "")))
    good = base64.b64encode(f"memcache:{token}".encode()).decode()
    req = urllib.request.Request(host + "/", headers={"Authorization": f"Basic {good}"})
    with urllib.request.urlopen(req, timeout=5) as r:   # follows the redirect with the header
        assert r.url.endswith("/status") and b"MemCache pool" in r.read()
