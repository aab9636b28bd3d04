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
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
