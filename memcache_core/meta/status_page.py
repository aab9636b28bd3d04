"""The status page (``GET /status`` on the admin port): the pool at a glance, as one HTML document.

Rendered from a ``stats.Snapshot`` outside the lock; no scripts, no external assets (it works on a
cluster without internet); the chart is inline SVG drawn from ``Snapshot.history``; the page
refreshes itself every few seconds.
"""

from __future__ import annotations

import time
from html import escape

from .stats import Snapshot, rates

REFRESH_S = 5
_CSS = """body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}h1{font-size:1.3em}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{padding:.25em .8em;border-bottom:1px solid #ddd;
text-align:left}th{background:#f4f4f4}.bar{width:14em;height:.9em;background:#e8e8e8;display:inline-block}
.bar>i{display:block;height:100%;background:#3b7dd8}.kv span{margin-right:2em}svg{background:#fafafa;
border:1px solid #ddd}.legend i{display:inline-block;width:1em;height:.3em;margin:0 .3em .2em 1em}"""


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _bar(used: int, cap: int) -> str:
    pct = 100.0 * used / cap if cap else 0.0
    return f'<span class="bar" title="{pct:.1f}%"><i style="width:{pct:.2f}%"></i></span> {pct:.1f}%'


def _summary(s: Snapshot) -> str:
    c = s.counters
    ratio = f"{100.0 * c['hits'] / c['lookups']:.1f}%" if c["lookups"] else "n/a"
    role = escape(s.role) + (f", term {s.term}" if s.term is not None else " (HA off)")
    items = [("Leader", role), ("Epoch", str(s.epoch)), ("Uptime", f"{s.uptime_s:.0f} s"),
             ("Members", str(len(s.members))), ("Objects", str(s.objects)),
             ("Used", f"{human(s.used_bytes)} of {human(s.capacity_bytes)}"), ("Hit ratio", ratio),
             ("Evictions", str(c["evictions"]))]
    return '<p class="kv">' + "".join(f'<span><b>{k}</b> <span id="{k.lower().replace(" ", "-")}">{v}'
                                      f"</span></span>" for k, v in items) + "</p>"


def _segments(s: Snapshot) -> str:
    rows = "".join(
        f'<tr class="segment" data-used="{g.used_bytes}"><td>{g.segment_id}</td><td>{escape(g.host_id)}</td>'
        f"<td>{g.pid if g.pid is not None else ''}</td><td>{escape(g.tier)}</td><td>{g.objects}</td>"
        f"<td>{human(g.used_bytes)} / {human(g.capacity_bytes)}</td><td>{_bar(g.used_bytes, g.capacity_bytes)}</td></tr>"
        for g in s.segments)
    return ("<h2>Segments</h2><table id=\"segments\"><tr><th>segment</th><th>host</th><th>pid</th><th>tier</th>"
            f"<th>objects</th><th>used / capacity</th><th>usage</th></tr>{rows}</table>")


def _members(s: Snapshot) -> str:
    rows = "".join(
        f'<tr class="member"><td>{m.client_id}</td><td>{escape(m.host_id)}</td><td>{m.pid}</td>'
        f"<td>{m.segment_id if m.segment_id is not None else 'client only'}</td><td>{m.last_seen_s:.1f} s ago</td></tr>"
        for m in s.members)
    return ("<h2>Members</h2><table id=\"members\"><tr><th>member</th><th>host</th><th>pid</th><th>segment</th>"
            f"<th>last heartbeat</th></tr>{rows}</table>")


def _chart(s: Snapshot, w: int = 640, h: int = 160) -> str:
    pts = rates(s.history)
    if len(pts) < 2:
        return '<p id="chart">The chart appears after a few samples (one every few seconds).</p>'
    t0, t1 = pts[0][0], pts[-1][0]
    top = max(max(r for _, _, r in pts), 1.0)

    def x(t: float) -> float:
        return 5 + (w - 10) * (t - t0) / max(t1 - t0, 1e-9)

    ratio = " ".join(f"{x(t):.1f},{h - 5 - (h - 10) * r:.1f}" for t, r, _ in pts if r is not None)
    rate = " ".join(f"{x(t):.1f},{h - 5 - (h - 10) * v / top:.1f}" for t, _, v in pts)
    return (f'<svg id="chart" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
            f'<polyline fill="none" stroke="#3b7dd8" stroke-width="2" points="{rate}"/>'
            f'<polyline fill="none" stroke="#d8663b" stroke-width="2" points="{ratio}"/></svg>'
            f'<p class="legend"><i style="background:#3b7dd8"></i>gets+puts per second (top {top:.0f}/s)'
            f'<i style="background:#d8663b"></i>hit ratio (0 to 100%) · last {(t1 - t0) / 60:.1f} min</p>')


def render(s: Snapshot) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.time))
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">'
            f"<title>MemCache pool</title><style>{_CSS}</style></head><body>"
            f"<h1>MemCache pool <small>{when}</small></h1>{_summary(s)}"
            f"<h2>Hit ratio and throughput</h2>{_chart(s)}{_segments(s)}{_members(s)}</body></html>")
