"""examples/grafana/memcache.json: every PromQL query names only metrics that a real MetaService and a
real LocalService (its metrics port) export."""

from __future__ import annotations

import json
import os
import re
import urllib.request

import pytest

from memcache_core import DistributedObjectStore
from memcache_core.testing import free_port

pytestmark = pytest.mark.integration

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "grafana", "memcache.json")
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def exported(text: str) -> set[str]:
    """Every series name a scrape shows: the TYPE lines' families and each sample's name."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            family, kind = line.split()[2:4]
            names.add(family)
            if kind == "histogram":
                names.update(family + s for s in ("_bucket", "_count", "_sum"))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def queries(dash: dict) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert out and all(isinstance(e, str) and e for e in out)
    return out


def test_every_dashboard_query_names_an_exported_metric(meta):
    with open(DASHBOARD, encoding="utf-8") as f:
        dash = json.load(f)
    assert dash["title"] and len(dash["panels"]) >= 10
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    port = free_port()
    s = DistributedObjectStore()
    assert s.setup(meta.local_config(metrics_port=port)) == 0 and s.init(0, True) == 0
    try:
        assert s.put("dash-1", b"d" * 10_000) == 0 and s.get("dash-1")
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=meta.admin_headers())
        with urllib.request.urlopen(req, timeout=5) as r:
            names = exported(meta.http("/metrics")) | exported(r.read().decode())
    finally:
        s.close()
    used = {m for e in queries(dash) for m in re.findall(r"\bmemcache_[a-z0-9_]+", e)}
    assert len(used) >= 15, used
    missing = sorted(m for m in used if m not in names)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("segment", "tier", "hit ratio", "throughput", "latency", "evictions", "members", "disk tier",
                  "served"):
        assert topic in titles, topic
    for family in ("memcache_disk_used_bytes", "memcache_disk_events_total", "memcache_disk_drops_total",
                   "memcache_local_served_bytes_total", "memcache_segment_served_bytes_total"):
        assert family in used, family


def test_every_query_follows_the_job_and_instance_variables():
    """Three MetaServices under HA (and providers under their own job): each query is scoped by the
    dashboard's job variable, and the MetaService's series by its instance variable too."""
    with open(DASHBOARD, encoding="utf-8") as f:
        dash = json.load(f)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= set(variables)
    assert variables["instance"]["includeAll"] and variables["instance"]["multi"]
    assert "$job" in variables["instance"]["definition"]
    for e in queries(dash):
        for name, sel in re.findall(r"\b(memcache_[a-z0-9_]+)(\{[^}]*\})?", e):
            assert 'job=~"$job"' in sel, (name, e)
            assert name.startswith("memcache_local_") or 'instance=~"$instance"' in sel, (name, e)
