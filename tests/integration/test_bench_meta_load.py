"""``benchmarks/bench_meta_load.py --quick``: the MetaService load benchmark still runs, checks every answer
it gets, and reports each figure (so it does not rot between the runs that give docs/operations.md its
capacity figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_meta_load.py")


def test_quick_run_reports_every_figure(tmp_path):
    res, png = tmp_path / "load.json", tmp_path / "load.png"
    out = subprocess.run([sys.executable, BENCH, "--quick", "--json", str(res), "--plot", str(png)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["phase"]: r for r in json.loads(res.read_text())["results"]}
    alone = ["exist", "probe", "probe sync", "lookup", "put+remove"]
    assert list(rows) == ["idle", "heartbeats", *alone, "mix", "mix x0.5", "mix x1"]
    for name in (*alone, "mix", "mix x0.5", "mix x1"):
        r = rows[name]
        assert r["requests"] > 0 and r["meta_cpu_s"] > 0 and r["rps_per_cpu_s"] > 0, r
    # each kind of the fleet's mix was sent and answered right (a wrong answer fails the run)
    assert {"exist", "probe", "lookup", "alloc", "commit", "remove"} <= set(rows["mix"]["counts"]), rows["mix"]
    assert rows["exist"]["keys"]["exist"] >= 16 * rows["exist"]["requests"]   # batches of 16-512 keys
    assert set(rows["put+remove"]["counts"]) == {"alloc", "commit", "remove"}, rows["put+remove"]
    assert rows["probe"]["probe_p50_us"] > 0 and rows["mix x1"]["offered_rps"] == rows["mix"]["rps"]
    assert "heartbeats of 16 members" in out.stdout
    half = rows["mix x0.5"]   # issue 26 quotes is_exist at half of saturation: its own line, p50 and p99
    assert f"p50 {half['probe_p50_us']} us, p99 {half['probe_p99_us']} us" in out.stdout
    assert 0 < half["probe_p50_us"] <= half["probe_p99_us"], half
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_wrong_answer_fails_the_run():
    """Negative control: the generator asks for stored keys that nobody stored (no members filled the
    table), so the first batched exist with a hit expected gets fewer; the phase must fail, naming it."""
    import argparse
    import importlib.util

    from memcache_core.auth import load_secret
    from memcache_core.config import parse_url
    from memcache_core.testing import running_meta_service
    spec = importlib.util.spec_from_file_location("bench_meta_load", BENCH)
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(objects=2000, connections=2, window=4, generators=1, seconds=2.0, heartbeat_ms=1000)
    with running_meta_service(log_level="warning") as ms:
        assert ms.pid is not None
        addr = parse_url(ms.meta_service_url, "meta_service_url", ("tcp",))
        with pytest.raises(SystemExit, match=r"exist: \d+ of \d+ keys found, expected \d+"):
            bench.run_phase("exist", ms.pid, addr, load_secret(ms.config.get("auth_secret_path", "")), args,
                            "exist=1", 0)


def test_heartbeat_cost_benchmark_runs():
    """``benchmarks/bench_heartbeat.py`` (the in-process cost of one heartbeat, quoted in
    benchmarks/README.md) still runs: its members join, every heartbeat is answered as known."""
    bench = os.path.join(os.path.dirname(BENCH), "bench_heartbeat.py")
    out = subprocess.run([sys.executable, bench, "--members", "8", "--rounds", "200", "--cold-rounds", "20",
                          "--gap-ms", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in out.stdout.splitlines()
            if line.split()[:1] in (["hot"], ["cold"])}
    assert set(rows) == {"hot", "cold"} and all(0 < r[2] <= r[1] for r in rows.values()), out.stdout
    assert "Python calls per heartbeat (cProfile, hot):" in out.stdout and "8 members" in out.stdout
