"""``bench_store.py --plot``: a PNG of GB/s against batch size, drawn from a results file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_store.py")


def test_plot_from_results(tmp_path):
    rows = [{"engine": "memcache", "protocol": proto, "layout": "contiguous", "batch": b, "op": op,
             "gbps": 1.0 + b / 10, "memcpy_gbps": 20.0, "ratio": 0.1, "ms": 1.0}
            for proto in ("host_shm", "host_tcp") for b in (1, 8, 32) for op in ("put", "get")]
    rows.append({"engine": "memcache", "protocol": "host_shm", "op": "is_exist", "p50_us": 20.0,
                 "p99_us": 50.0, "n": 100})
    res = tmp_path / "r.json"
    res.write_text(json.dumps({"argv": [], "results": rows}))
    png = tmp_path / "out.png"
    out = subprocess.run([sys.executable, BENCH, "--table", str(res), "--plot", str(png)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_ttft_bars(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("plots", os.path.join(os.path.dirname(BENCH), "plots.py"))
    assert spec and spec.loader
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    png = tmp_path / "ttft.png"
    plots.ttft_bars({"cold": [0.9, 1.0, 1.1], "restored from L3": [0.2, 0.25, 0.3]}, str(png), "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
