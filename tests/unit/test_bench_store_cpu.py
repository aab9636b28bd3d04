"""``bench_store.py``'s CPU time per small op: the per-process CPU clocks it sums over the pool,
and the ``--table`` rows that show it beside the latencies."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _common() -> Any:
    sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location("bench_store_common", os.path.join(BENCH, "bench_store_common.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pool_cpu_counts_threads_and_children():
    """A process whose child burns CPU in a thread that then ends: that time shows up under the
    parent's name, and an idle process shows next to none."""
    common = _common()
    burn = ("import subprocess, sys, threading, time\n"
            "code = 'import threading, time\\n"
            "def spin():\\n t = time.thread_time() + 0.3\\n while time.thread_time() < t: pass\\n"
            "th = threading.Thread(target=spin); th.start(); th.join(); time.sleep(30)'\n"
            "c = subprocess.Popen([sys.executable, '-c', code]); print('go', flush=True); c.wait()\n")
    busy = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout is not None and busy.stdout is not None
        assert idle.stdout.readline().strip() == "up"   # its start-up is over before the first reading
        assert busy.stdout.readline().strip() == "go"
        pool = {"busy": busy.pid, "idle": idle.pid}
        before = common.pool_cpu_ns(pool)
        time.sleep(1.5)   # the grandchild's thread spins 0.3 s of CPU, then sleeps
        after = common.pool_cpu_ns(pool)
        split = common.cpu_split(before, after, ops=1000)
        # 0.3 s over 1000 ops = 300 us/op (plus the grandchild's start-up, which may fall in the window)
        assert 250 <= split["busy"] <= 600, split
        assert split["idle"] < 5, split
        assert split["all"] == round((sum(after.values()) - sum(before.values())) / 1000 / 1e3, 1)
        assert common.pool_cpu_ns({"gone": 2**22 + 7}) == {"gone": 0}
    finally:
        for p in (busy, idle):
            for c in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split():
                os.kill(int(c), 9)
            p.kill()
            p.wait()


def test_table_shows_cpu_beside_latency(tmp_path):
    files = []
    for engine, cpu in (("memcache", {"all": 345.4, "meta": 120.0, "writer": 100.2, "reader": 125.2}),
                        ("mooncake", {"all": 150.0, "master": 20.0, "writer": 60.0, "reader": 70.0})):
        rows = [{"engine": engine, "protocol": "host_tcp", "op": "get", "n": 2000, "p50_us": 90.0,
                 "p99_us": 200.0, "cpu_us": cpu},
                {"engine": engine, "protocol": "host_tcp", "op": "is_exist", "n": 2000, "p50_us": 40.0,
                 "p99_us": 80.0}]   # an older result file: no CPU figures
        files.append(tmp_path / f"{engine}.json")
        files[-1].write_text(json.dumps({"argv": [], "results": rows}))
    out = subprocess.run([sys.executable, os.path.join(BENCH, "bench_store.py"), "--table", *map(str, files)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cpu_line = next(line for line in out.stdout.splitlines() if line.startswith("cpu us/op") and "get" in line)
    assert " 345 (120/100/125)" in cpu_line and " 150 (20/60/70)" in cpu_line
    assert not any(line.startswith("cpu us/op") and "is_exist" in line for line in out.stdout.splitlines())
