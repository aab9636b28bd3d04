"""``memcache status [--watch]``, ``memcache keys --prefix P``, ``memcache remove --prefix P``,
``memcache drain SEGMENT``.

Admin clients of a MetaService's HTTP admin port (``metrics_url``). They authenticate with the
pool's admin token, derived from the pool secret (``--secret-path``, else the default secret file)
or given as ``--token`` / ``$MEMCACHE_ADMIN_TOKEN``. Tables are drawn with ``rich`` (the ``cli``
extra).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl
import time
import urllib.error
import urllib.request
from typing import Any

import msgspec

from .meta.stats import Snapshot, rates
from .meta.status_page import human


def add_parsers(sub: Any) -> None:
    for name, help_ in (("status", "the pool at a glance (members, segments, hit ratio)"),
                        ("keys", "list committed keys (with --prefix, those starting with it)"),
                        ("remove", "remove every committed key starting with --prefix"),
                        ("drain", "move a segment's objects to the others, with a progress bar")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--url", default=os.environ.get("MEMCACHE_ADMIN_URL", "http://127.0.0.1:8000"),
                        help="the MetaService's metrics_url (default $MEMCACHE_ADMIN_URL or %(default)s)")
        sp.add_argument("--secret-path", default="", help="pool secret file (default: the pool's default)")
        sp.add_argument("--token", default=os.environ.get("MEMCACHE_ADMIN_TOKEN", ""),
                        help="admin token instead of the secret ($MEMCACHE_ADMIN_TOKEN)")
        sp.add_argument("--no-auth", action="store_true", help="the pool runs with auth_enable: false")
        sp.add_argument("--cacert", default="", help="CA file for an https admin URL")
        if name == "status":
            sp.add_argument("--watch", action="store_true", help="redraw until interrupted")
            sp.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (--watch)")
        elif name == "drain":
            sp.add_argument("segment", type=int, help="the segment id (memcache status lists them)")
            sp.add_argument("--timeout-ms", type=int, default=0,
                            help="the drain's time limit (default: the MetaService's drain_timeout_ms)")
            sp.add_argument("--no-wait", action="store_true", help="start the drain and return")
        else:
            sp.add_argument("--prefix", default="", required=name == "remove", help="key prefix")


class AdminClient:
    def __init__(self, args: argparse.Namespace) -> None:
        self.url = args.url.rstrip("/")
        self.headers: dict[str, str] = {}
        if not args.no_auth:
            token = args.token
            if not token:
                from .auth import admin_token, load_secret
                token = admin_token(load_secret(args.secret_path))
            self.headers["Authorization"] = f"Bearer {token}"
        self.ctx = ssl.create_default_context(cafile=args.cacert or None) if self.url.startswith("https") else None

    def call(self, path: str, method: str = "GET") -> bytes:
        req = urllib.request.Request(self.url + path, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10, context=self.ctx) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            raise SystemExit(f"memcache: {self.url}{path}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e
        except OSError as e:
            raise SystemExit(f"memcache: cannot reach the MetaService admin port at {self.url}: {e}") from e


def _tables(s: Snapshot) -> Any:
    from rich.console import Group
    from rich.table import Table
    c = s.counters
    ratio = f"{100.0 * c['hits'] / c['lookups']:.1f}%" if c["lookups"] else "n/a"
    recent = [r for r in rates(s.history) if r[1] is not None]
    head = Table.grid(padding=(0, 3))
    head.add_row(f"role [b]{s.role}[/b]" + (f" term {s.term}" if s.term is not None else " (HA off)"),
                 f"epoch {s.epoch}", f"uptime {s.uptime_s:.0f} s", f"members {len(s.members)}",
                 f"objects {s.objects}", f"used {human(s.used_bytes)} / {human(s.capacity_bytes)}",
                 f"hit ratio {ratio}" + (f" (last interval {100 * (recent[-1][1] or 0):.1f}%)" if recent else ""),
                 f"evictions {c['evictions']}")
    segs = Table(title="segments")
    for col in ("segment", "host", "pid", "tier", "objects", "used", "capacity", "usage"):
        segs.add_column(col, justify="right" if col in ("objects", "used", "capacity", "usage") else "left")
    for g in s.segments:
        pct = 100.0 * g.used_bytes / g.capacity_bytes if g.capacity_bytes else 0.0
        bar = "█" * round(pct / 10) + "░" * (10 - round(pct / 10))
        segs.add_row(str(g.segment_id), g.host_id, str(g.pid or ""), g.tier, str(g.objects),
                     human(g.used_bytes), human(g.capacity_bytes), f"{bar} {pct:5.1f}%")
    owners = {g.segment_id: g for g in s.segments}
    for d in s.disk_tiers:   # a provider's disk tier, under its segment
        g_ = owners.get(d.segment_id)
        pct = 100.0 * d.used_bytes / d.capacity_bytes if d.capacity_bytes else 0.0
        bar = "█" * round(pct / 10) + "░" * (10 - round(pct / 10))
        segs.add_row(str(d.segment_id), g_.host_id if g_ else "", str(g_.pid or "") if g_ else "", "disk",
                     str(d.objects), human(d.used_bytes), human(d.capacity_bytes), f"{bar} {pct:5.1f}%")
    members = Table(title="members")
    for col in ("member", "host", "pid", "segment", "last heartbeat"):
        members.add_column(col)
    for m in s.members:
        members.add_row(str(m.client_id), m.host_id, str(m.pid),
                        str(m.segment_id) if m.segment_id is not None else "client only", f"{m.last_seen_s:.1f} s ago")
    return Group(head, segs, members)


def status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    client, console = AdminClient(args), Console()

    def snap() -> Snapshot:
        return msgspec.json.decode(client.call("/api/v1/stats"), type=Snapshot)
    if not args.watch:
        console.print(_tables(snap()))
        return 0
    # Ctrl-C / SIGTERM set a flag that the loop checks between redraws: a KeyboardInterrupt raised at
    # an arbitrary point (inside an HTTP read or the terminal library) could be lost there.
    stopped: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopped.append(signum))

    def pause() -> bool:
        """Wait one interval; False once a signal asked to stop."""
        end = time.monotonic() + max(args.interval, 0.1)
        while not stopped and time.monotonic() < end:
            time.sleep(0.05)
        return not stopped
    if not console.is_terminal:   # a pipe or a file: one table per interval, no cursor movement
        while not stopped:
            console.print(_tables(snap()))
            console.file.flush()
            pause()
        return 0
    with Live(_tables(snap()), console=console, auto_refresh=False) as live:
        while pause():
            live.update(_tables(snap()), refresh=True)
    return 0


def keys(args: argparse.Namespace) -> int:
    from urllib.parse import quote
    body = json.loads(AdminClient(args).call("/keys?prefix=" + quote(args.prefix)))
    for k in sorted(body["keys"]):
        print(k)
    return 0


def remove(args: argparse.Namespace) -> int:
    from urllib.parse import quote
    body = json.loads(AdminClient(args).call("/remove_prefix?prefix=" + quote(args.prefix), method="POST"))
    if not body.get("success"):
        raise SystemExit(f"memcache: remove --prefix {args.prefix!r}: {body.get('error_message')}")
    print(f"removed {body['removed']} objects with prefix {args.prefix!r}")
    return 0


def drain(args: argparse.Namespace) -> int:
    """Start a drain (POST /drain/<id>) and follow GET /drain/<id> until it ends; 0 when every object
    moved, 1 when some were dropped or the drain timed out."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    client = AdminClient(args)
    path = f"/drain/{args.segment}"
    state = json.loads(client.call(path + (f"?timeout_ms={args.timeout_ms}" if args.timeout_ms else ""), "POST"))
    if not state.get("success"):
        raise SystemExit(f"memcache: drain {args.segment}: {state.get('error_message')}")
    if args.no_wait:
        print(f"draining segment {args.segment}: {state['objects_left']} objects")
        return 0
    columns = (TextColumn("segment {task.fields[segment]}"), BarColumn(), TextColumn("{task.completed}/{task.total} "
               "objects moved, {task.fields[dropped]} dropped"), TimeElapsedColumn())
    with Progress(*columns) as bar:
        task = bar.add_task("drain", total=None, segment=args.segment, dropped=0)
        while True:
            done = state["moved_objects"] + state["dropped_objects"]
            bar.update(task, completed=state["moved_objects"], total=done + state["objects_left"],
                       dropped=state["dropped_objects"])
            if state["state"] != "draining":
                break
            time.sleep(0.2)
            state = json.loads(client.call(path))
    print(f"segment {args.segment}: {state['state']}, {state['moved_objects']} objects "
          f"({human(state['moved_bytes'])}) moved, {state['dropped_objects']} dropped")
    return 0 if state["state"] == "done" and state["dropped_objects"] == 0 else 1

