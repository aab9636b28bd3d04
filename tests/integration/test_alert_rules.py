"""examples/prometheus/memcache-alerts.yml: Prometheus's own ``promtool`` checks the rules and runs
their unit tests (memcache-alerts.test.yml: synthetic series that must fire them); every metric they
name is one a real MetaService exports; everything docs/operations.md tells operators to watch has
an alert. ``promtool`` is Debian's ``prometheus`` package (.ci/run installs it): this test fails,
never skips, without it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.integration.test_grafana_dashboard import exported

pytestmark = pytest.mark.integration

HERE = os.path.dirname(__file__)
RULES = os.path.join(HERE, "..", "..", "examples", "prometheus", "memcache-alerts.yml")
RULE_TESTS = os.path.join(HERE, "..", "..", "examples", "prometheus", "memcache-alerts.test.yml")
OPERATIONS = os.path.join(HERE, "..", "..", "docs", "operations.md")


def rules() -> list[dict]:
    with open(RULES, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return [r for g in doc["groups"] for r in g["rules"]]


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: apt-get install prometheus (Debian's package brings /usr/bin/promtool)"
    return path


def test_promtool_checks_the_rules_and_their_unit_tests() -> None:
    for args in (["check", "rules", RULES], ["test", "rules", RULE_TESTS]):
        out = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


def test_every_rule_names_exported_metrics_and_says_what_to_do(meta) -> None:
    names = exported(meta.http("/metrics"))
    seen = set()
    for r in rules():
        assert re.fullmatch(r"MemCache[A-Za-z]+", r["alert"]) and r["alert"] not in seen, r["alert"]
        seen.add(r["alert"])
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r
        assert r["annotations"]["summary"] and r["annotations"]["description"], r
        used = re.findall(r"\bmemcache_[a-z0-9_]+", r["expr"])
        assert used or r["expr"].startswith("up{"), r
        missing = [m for m in used if m not in names]
        assert not missing, f"{r['alert']} queries metrics nobody exports: {missing}"


def test_everything_operations_md_says_to_watch_has_an_alert() -> None:
    with open(OPERATIONS, encoding="utf-8") as f:
        text = f.read()
    watch = text[text.index("Watch: "):text.index("## Grafana")]
    named = set(re.findall(r"`([a-z_]+)(?:\{[^`]*\})?`", watch)) - {"replicaNum", "disk_size"}
    exprs = " ".join(r["expr"] for r in rules())
    assert len(named) >= 8, named
    missing = sorted(n for n in named if f"memcache_{n}" not in exprs and n not in exprs)
    assert not missing, f"docs/operations.md says to watch these, and no alert does: {missing}"
