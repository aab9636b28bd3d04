"""The status page (``GET /status`` on the admin port): the pool at a glance, as one HTML document.

Rendered from a ``stats.Snapshot`` outside the lock; no scripts, no external assets (it works on a
cluster without internet); the chart is inline SVG drawn from ``Snapshot.history``, with axes, and
with gaps where there is nothing to draw (no gets in an interval: no hit ratio; samples missing: no
line across the hole); the page refreshes itself every few seconds. The header (the title, then one
line of figures) does not wrap down to 1,400 px wide. What needs an operator (under-replicated objects, integrity failures, drains, disk
errors) is in the header and in tables of its own.
"""

from __future__ import annotations

import time
from html import escape

from .stats import Snapshot, rates

REFRESH_S = 5
DISK_ERRORS = ("write_errors", "read_errors", "integrity_failures")
_CSS = """body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
header{white-space:nowrap;border-bottom:1px solid #ddd;padding-bottom:.4em}h1{font-size:1.3em;margin:0 0 .3em}
h1 small{font-weight:normal;color:#666;font-size:.65em;margin-left:1em}
.kv{display:flex;gap:.85em;margin:0;font-size:.93em}.kv>span{white-space:nowrap}.warn{color:#b3261e}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{padding:.25em .8em;border-bottom:1px solid #ddd;
text-align:left;white-space:nowrap}th{background:#f4f4f4}.bar{width:14em;height:.9em;background:#e8e8e8;display:inline-block}
.bar>i{display:block;height:100%;background:#3b7dd8}svg{background:#fafafa;border:1px solid #ddd}
svg text{font:11px system-ui,sans-serif;fill:#555}.legend i{display:inline-block;width:1em;height:.3em;
margin:0 .3em .2em 1em}"""


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _bar(used: int, cap: int) -> str:
    pct = 100.0 * used / cap if cap else 0.0
    return f'<span class="bar" title="{pct:.1f}%"><i style="width:{pct:.2f}%"></i></span> {pct:.1f}%'


def _header(s: Snapshot) -> str:
    c = s.counters
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.time))
    ratio = f"{100.0 * c['hits'] / c['lookups']:.1f}%" if c["lookups"] else "n/a"
    role = escape(s.role) + (f", term {s.term}" if s.term is not None else " (HA off)")
    items = [("Leader", role, False), ("Uptime", _duration(s.uptime_s), False),
             ("Members", str(len(s.members)), False), ("Objects", _count(s.objects), False),
             ("Used", f"{human(s.used_bytes)} of {human(s.capacity_bytes)}", False), ("Hit ratio", ratio, False),
             ("Evictions", _count(c["evictions"]), False),
             ("Under-replicated", str(s.under_replicated), s.under_replicated > 0),
             ("Integrity failures", str(c.get("integrity_failures", 0)), c.get("integrity_failures", 0) > 0),
             ("Draining", str(len(s.drains_in_progress)), bool(s.drains_in_progress))]
    kv = "".join(f'<span{" class=warn" if warn else ""}><b>{k}</b> <span id="{k.lower().replace(" ", "-")}">{v}'
                 f"</span></span>" for k, v, warn in items)
    return (f'<header><h1>MemCache pool <small>{when} · epoch <span id="epoch">{s.epoch}</span> · refreshed '
            f'every {REFRESH_S} s</small></h1><p class="kv" id="summary">{kv}</p></header>')


def _duration(s: float) -> str:
    return (f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h" if s < 172800
            else f"{s / 86400:.1f} d")


def _count(n: int) -> str:
    """A count short enough for the header: 987654321 -> 987.7 M."""
    for div, unit in ((10**9, "G"), (10**6, "M")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return str(n)


def _table(title: str, table_id: str, headers: tuple[str, ...], rows: str) -> str:
    """A section of the page: its heading and a table of ``rows`` (already escaped) under ``headers``."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    return f'<h2>{title}</h2><table id="{table_id}"><tr>{head}</tr>{rows}</table>'


def _segments(s: Snapshot) -> str:
    rows = "".join(
        f'<tr class="segment" data-used="{g.used_bytes}"><td>{g.segment_id}</td><td>{escape(g.host_id)}</td>'
        f"<td>{g.pid if g.pid is not None else ''}</td><td>{escape(g.tier)}</td><td>{g.objects}</td>"
        f"<td>{human(g.used_bytes)} / {human(g.capacity_bytes)}</td><td>{_bar(g.used_bytes, g.capacity_bytes)}</td>"
        f"<td>{g.state}</td><td>{escape(g.metrics_addr)}</td></tr>"
        for g in s.segments)
    return _table("Segments", "segments", ("segment", "host", "pid", "tier", "objects", "used / capacity", "usage",
                                            "state", "metrics"), rows)


def _disk_tiers(s: Snapshot) -> str:
    if not s.disk_tiers:
        return '<h2>Disk tiers</h2><p id="disk-tiers">No provider has a disk tier (<code>disk_path</code>).</p>'
    rows = "".join(
        f'<tr class="disk-tier"><td>{d.segment_id}</td><td>{escape(d.policy)}</td><td>{d.objects}</td>'
        f"<td>{human(d.used_bytes)} / {human(d.capacity_bytes)}</td><td>{_bar(d.used_bytes, d.capacity_bytes)}</td>"
        f"<td>{d.counters.get('writes', 0)}</td><td>{d.counters.get('reads', 0)}</td>"
        f"<td{' class=warn' if errs else ''}>{errs}</td></tr>"
        for d in s.disk_tiers for errs in [sum(d.counters.get(k, 0) for k in DISK_ERRORS)])
    return _table("Disk tiers", "disk-tiers", ("segment", "policy", "records", "used / capacity", "usage", "writes",
                                                "reads", "errors"), rows)


def _drains(s: Snapshot) -> str:
    if not s.drains_in_progress:
        return ""
    rows = "".join(
        f'<tr class="drain"><td>{d["segment_id"]}</td><td>{escape(str(d["reason"]))}</td>'
        f'<td>{d["elapsed_s"]:.0f} s of {d["timeout_s"]:.0f} s</td><td>{d["objects_left"]}</td>'
        f'<td>{d["moved_objects"]} ({human(d["moved_bytes"])})</td><td>{d["dropped_objects"]}</td></tr>'
        for d in s.drains_in_progress)
    return _table("Drains in progress", "drains", ("segment", "reason", "elapsed", "objects left", "moved", "dropped"),
                  rows)


def _runs(points: list[tuple[float, float | None]], gap_s: float) -> list[list[tuple[float, float]]]:
    """The points cut into runs: a None (nothing to plot) or a hole in time longer than ``gap_s``
    ends a run, so a line never bridges a time it knows nothing about."""
    runs: list[list[tuple[float, float]]] = []
    last_t = None
    for t, v in points:
        if v is None or (last_t is not None and t - last_t > gap_s):
            runs.append([])
        if v is not None:
            if not runs:
                runs.append([])
            runs[-1].append((t, v))
        last_t = t
    return [r for r in runs if r]


def _chart(s: Snapshot, w: int = 720, h: int = 190) -> str:
    pts = rates(s.history)
    if len(pts) < 2:
        return '<p id="chart">The chart appears after a few samples (one every few seconds).</p>'
    left, right, top_pad, bottom = 52, 44, 8, 22     # room for the axes' labels
    t0, t1 = pts[0][0], pts[-1][0]
    top = max(max(r for _, _, r in pts), 1.0)
    span = max(t1 - t0, 1e-9)
    steps = sorted(b[0] - a[0] for a, b in zip(pts, pts[1:], strict=False))
    gap_s = 2.5 * max(s.sample_interval_s, steps[len(steps) // 2])   # a hole: samples missed, not late

    def x(t: float) -> float:
        return left + (w - left - right) * (t - t0) / span

    def y(frac: float) -> float:
        return h - bottom - (h - bottom - top_pad) * frac

    def lines(runs: list[list[tuple[float, float]]], color: str, cls: str) -> str:
        out = []
        for run in runs:
            xy = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in run)
            if len(run) == 1:   # a lone sample between gaps: a dot, not nothing
                out.append(f'<circle class="{cls}" cx="{x(run[0][0]):.1f}" cy="{y(run[0][1]):.1f}" r="2" '
                           f'fill="{color}"/>')
            else:
                out.append(f'<polyline class="{cls}" fill="none" stroke="{color}" stroke-width="2" points="{xy}"/>')
        return "".join(out)

    axes = [f'<line x1="{left}" y1="{y(0)}" x2="{w - right}" y2="{y(0)}" stroke="#999"/>',
            f'<line x1="{left}" y1="{y(0)}" x2="{left}" y2="{y(1)}" stroke="#999"/>',
            f'<line x1="{w - right}" y1="{y(0)}" x2="{w - right}" y2="{y(1)}" stroke="#999"/>']
    for frac in (0.0, 0.5, 1.0):   # left: operations per second; right: hit ratio
        axes.append(f'<line x1="{left}" y1="{y(frac):.1f}" x2="{w - right}" y2="{y(frac):.1f}" stroke="#eee"/>')
        axes.append(f'<text class="y-left" x="{left - 4}" y="{y(frac) + 4:.1f}" text-anchor="end">'
                    f"{top * frac:.0f}/s</text>")
        axes.append(f'<text class="y-right" x="{w - right + 4}" y="{y(frac) + 4:.1f}">{frac * 100:.0f}%</text>')
    for frac in (0.0, 0.5, 1.0):   # time: how long ago
        ago = (t1 - (t0 + span * frac)) / 60
        label = "now" if frac == 1.0 else f"-{ago:.1f} min"
        axes.append(f'<text class="x" x="{x(t0 + span * frac):.1f}" y="{h - 6}" text-anchor="middle">{label}</text>')
    rate_runs = _runs([(t, v / top) for t, _, v in pts], gap_s)
    ratio_runs = _runs([(t, r) for t, r, _ in pts], gap_s)
    return (f'<svg id="chart" width="{w}" height="{h}" viewBox="0 0 {w} {h}">{"".join(axes)}'
            f'{lines(rate_runs, "#3b7dd8", "rate")}{lines(ratio_runs, "#d8663b", "ratio")}</svg>'
            f'<p class="legend"><i style="background:#3b7dd8"></i>gets+puts per second (left axis)'
            f'<i style="background:#d8663b"></i>hit ratio (right axis; a gap: no gets, or no samples)</p>')


def render(s: Snapshot) -> str:
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">'
            f"<title>MemCache pool</title><style>{_CSS}</style></head><body>{_header(s)}"
            f"<h2>Hit ratio and throughput</h2>{_chart(s)}{_drains(s)}{_segments(s)}{_disk_tiers(s)}"
            f"{_members(s)}</body></html>")


def _members(s: Snapshot) -> str:
    rows = "".join(
        f'<tr class="member"><td>{m.client_id}</td><td>{escape(m.host_id)}</td><td>{m.pid}</td>'
        f"<td>{m.segment_id if m.segment_id is not None else 'client only'}</td><td>{m.last_seen_s:.1f} s ago</td>"
        f"<td>{_count(m.kept_objects)}</td></tr>"
        for m in s.members)
    return _table("Members", "members", ("member", "host", "pid", "segment", "last heartbeat", "objects kept"), rows)
