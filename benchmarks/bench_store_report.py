"""``bench_store.py``'s report: a bandwidth row from the timed repetitions, one printed line per row,
earlier runs side by side (``--table``) and the plot (``--plot``)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

from bench_store_common import KIB, OBJ_BYTES


def bandwidth_row(engine: str, protocol: str, layout: str, batch: int, op: str,
                   rs: list[dict[str, Any]]) -> dict[str, Any]:
    nbytes = batch * OBJ_BYTES
    t, mc = statistics.median(r["s"] for r in rs), statistics.median(r["memcpy_s"] for r in rs)
    return {"engine": engine, "protocol": protocol, "layout": layout, "batch": batch, "op": op,
            "gbps": round(nbytes / t / 1e9, 3), "memcpy_gbps": round(nbytes / mc / 1e9, 3),
            "ratio": round(statistics.median(r["memcpy_s"] / r["s"] for r in rs), 3), "ms": round(t * 1e3, 2), "reps": len(rs),
            "piece_ratio": round(statistics.median(r["piece_memcpy_s"] / r["s"] for r in rs), 3),
            "faults_per_mib": round(statistics.median(r["faults"] for r in rs) / (nbytes / (1 << 20)), 1),
            "off_path_reps": sum(bool(r.get("paths")) and r["paths"] != [_path(protocol, op)] for r in rs)}


def _path(protocol: str, op: str) -> str:
    """The transfer path an op of a row is meant to measure (a put lands in the writer's own segment)."""
    return "host_shm" if op == "put" or protocol == "host_shm" else protocol


def print_row(row: dict[str, Any]) -> None:
    if "gbps" in row:
        extra = f"  cold {row['cold_get_gbps']:6.2f} GB/s" if "cold_get_gbps" in row else ""
        print(f"{row['engine']:8} {row['protocol']:8} {row['layout']:10} {row['batch']:>3} {row['op']:9}"
              f" {row['gbps']:7.2f} GB/s  memcpy {row['memcpy_gbps']:6.2f} GB/s  x{row['ratio']:.2f}"
              f"  {row['ms']:8.2f} ms  {row['faults_per_mib']:4.0f} flt/MiB{extra}"
              + (f"  (x{row['piece_ratio']:.2f} of memcpy piece by piece)" if row["layout"] == "layered" else "")
              + (f"  [{row['off_path_reps']} of {row['reps']} reps not all through {_path(row['protocol'], row['op'])}:"
                 " the writer's segment was full]" if row.get("off_path_reps") else ""), flush=True)
    else:
        cpu = row.get("cpu_us")
        split = (f"  cpu {cpu['all']:7.1f} us/op ("
                 + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items() if k != "all") + ")") if cpu else ""
        print(f"{row['engine']:8} {row['protocol']:8} {'4KiB' if 'batch' not in row['op'] else '1000 keys':10}"
              f"     {row['op']:21} p50 {row['p50_us']:8.1f} us  p99 {row['p99_us']:8.1f} us{split}  (n={row['n']})",
              flush=True)


def cpu_cell(cpu: dict[str, float]) -> str:
    """CPU µs per op over the pool, then its split in the pool's order (server/writer/reader)."""
    return f"{cpu['all']:4.0f} ({'/'.join(f'{v:.0f}' for k, v in cpu.items() if k != 'all')})"


def print_table(paths: list[str]) -> None:
    """Side by side: one column per (engine, protocol) found in the JSON files of earlier runs."""
    cols: list[tuple[str, str]] = []
    cells: dict[tuple[Any, ...], dict[tuple[str, str], str]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)["results"]
        for r in results:
            col = (r["engine"], r["protocol"])
            if col not in cols:
                cols.append(col)
            if "failed" in r:
                for op in ("put", "put>peer", "get"):
                    cells.setdefault((r["layout"], r["batch"], op), {})[col] = "FAILED"
            elif "gbps" in r:
                key: tuple[Any, ...] = (r["layout"], r["batch"], r["op"])
                cells.setdefault(key, {})[col] = f"{r['gbps']:5.2f} GB/s x{r['ratio']:.2f}"
            else:
                cells.setdefault(("small", 0, r["op"]), {})[col] = f"{r['p50_us']:6.0f} / {r['p99_us']:<6.0f}us"
                if r.get("cpu_us"):
                    cells.setdefault(("cpu", 0, r["op"]), {})[col] = cpu_cell(r["cpu_us"])
    head = f"{'layout':10} {'batch':>5} {'op':21}" + "".join(f" | {e + ' ' + p:19}" for e, p in cols)
    print(head + "\n" + "-" * len(head))
    for (layout, batch, op), row in cells.items():
        label = (f"{layout:10} {batch:>5} {op:21}" if layout not in ("small", "cpu") else
                 f"{'p50 / p99' if layout == 'small' else 'cpu us/op':10} {'':>5} {op:21}")
        print(label + "".join(f" | {row.get(c, '-'):19}" for c in cols))
    if any(layout == "cpu" for layout, _, _ in cells):
        print("cpu us/op: on-CPU time per op summed over the pool's processes (server/writer/reader: the "
              "MetaService or mooncake_master, the writer, the reader; all their threads), from each process's CPU clock")


def plot(rows: list[dict[str, Any]], path: str) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plots
    return plots.bandwidth(rows, path, f"object {OBJ_BYTES // KIB} KiB; medians")
