"""The status page in a real headless browser (Debian's Chromium), against a running pool."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from memcache_core import DistributedObjectStore
from memcache_core.auth import admin_token, load_secret
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
    with running_meta_service(heartbeat_timeout_ms=1500, stats_sample_interval_seconds=0.2) as meta:
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
