"""``memcache status [--watch | --json]``, ``memcache keys --prefix P``, ``memcache remove --prefix P``,
``memcache drain SEGMENT``, ``memcache token`` (``memcache secrets`` and ``memcache forget-pool``:
``cli_secrets.py``).

Admin clients of a MetaService's HTTP admin port (``metrics_url``). They authenticate with the
pool's admin token, derived from the pool secret (``--secret-path``, else the default secret file)
or given as ``--token`` / ``$MEMCACHE_ADMIN_TOKEN``; ``memcache token`` prints that token (for
Prometheus and curl). Tables are drawn with ``rich`` (the ``cli`` extra) and fit 80 columns: ids are
never cut, hosts are.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import msgspec

from .auth import SECRET_ENV, default_secret_path
from .cli_secrets import named_pools
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
        sp.add_argument("--pool-name", default=os.environ.get("MEMCACHE_POOL_NAME", ""),
                        help="the pool's pool_name, which names its default secret file ($MEMCACHE_POOL_NAME)")
        sp.add_argument("--token", default=os.environ.get("MEMCACHE_ADMIN_TOKEN", ""),
                        help="admin token instead of the secret ($MEMCACHE_ADMIN_TOKEN)")
        sp.add_argument("--no-auth", action="store_true", help="the pool runs with auth_enable: false")
        sp.add_argument("--cacert", default="", help="CA file for an https admin URL")
        if name == "status":
            sp.add_argument("--json", action="store_true", help="print the snapshot (/api/v1/stats) as JSON")
            sp.add_argument("--watch", action="store_true", help="redraw until interrupted")
            sp.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (--watch)")
        elif name == "drain":
            sp.add_argument("segment", type=int, help="the segment id (memcache status lists them)")
            sp.add_argument("--timeout-ms", type=int, default=0,
                            help="the drain's time limit (default: the MetaService's drain_timeout_ms)")
            sp.add_argument("--no-wait", action="store_true", help="start the drain and return")
        else:
            sp.add_argument("--prefix", default="", required=name == "remove", help="key prefix")
    sp = sub.add_parser("token", help="print the admin token (Authorization: Bearer ...) for Prometheus or curl")
    sp.add_argument("--secret-path", default="", help="pool secret file (default: the pool's default)")
    sp.add_argument("--pool-name", default=os.environ.get("MEMCACHE_POOL_NAME", ""),
                    help="the pool's pool_name, which names its default secret file ($MEMCACHE_POOL_NAME)")


def token(args: argparse.Namespace) -> int:
    if not args.secret_path and not args.pool_name and not os.environ.get(SECRET_ENV):
        others = named_pools()
        if others:   # the unnamed pool's token, where the operator may have meant a named pool's
            print(f"memcache: warning: no --pool-name: this is the token of the pool without a pool_name "
                  f"(secret {default_secret_path()}); this host also holds the secrets of the pools named "
                  f"{', '.join(others)}: pass --pool-name NAME for one of them (`memcache secrets` lists "
                  f"them)", file=sys.stderr)
    print(_admin_token(args.secret_path, args.pool_name))
    return 0


def _admin_token(secret_path: str, pool_name: str = "") -> str:
    """The admin token of the pool whose secret is at ``secret_path`` (empty: the default file); a
    secret that cannot be read is a one-line error naming the file and what to do."""
    from .auth import admin_token, load_secret
    from .errors import ConfigError
    try:
        return admin_token(load_secret(secret_path, pool_name=pool_name))
    except ConfigError as e:
        raise SystemExit(f"memcache: {e}. Pass the pool's secret file with --secret-path (the MetaService's "
                         f"auth_secret_path; default {default_secret_path(pool_name)}) or its --pool-name (the "
                         f"pool_name setting), or the token with --token or $MEMCACHE_ADMIN_TOKEN") from None


class AdminClient:
    def __init__(self, args: argparse.Namespace) -> None:
        self.url = args.url.rstrip("/")
        self.headers: dict[str, str] = {}
        self.credential = ""   # where the token came from, for a 401
        if not args.no_auth:
            token = args.token or _admin_token(args.secret_path, args.pool_name)
            self.headers["Authorization"] = f"Bearer {token}"
            self.credential = _credential(args)
        self.ctx = ssl.create_default_context(cafile=args.cacert or None) if self.url.startswith("https") else None

    def call(self, path: str, method: str = "GET") -> bytes:
        req = urllib.request.Request(self.url + path, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10, context=self.ctx) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            if e.code == 401:
                raise SystemExit(f"memcache: {self.url}{path}: HTTP 401: the MetaService refused {self.credential}"
                                 if self.credential else f"memcache: {self.url}{path}: HTTP 401: the MetaService "
                                 f"asks for the admin token (it runs with authentication): drop --no-auth") from e
            raise SystemExit(f"memcache: {self.url}{path}: HTTP {e.code}: {body}") from e
        except OSError as e:
            raise SystemExit(f"memcache: cannot reach the MetaService admin port at {self.url}: {e}") from e


def _credential(args: argparse.Namespace) -> str:
    """What a 401 answers: the token we sent, where it came from, and how to send the right one."""
    if args.token:
        source = "--token" if args.token != os.environ.get("MEMCACHE_ADMIN_TOKEN") else "$MEMCACHE_ADMIN_TOKEN"
        return (f"the admin token given with {source}: it is not this pool's (`memcache token` prints it from "
                f"the pool's secret)")
    path = args.secret_path or default_secret_path(args.pool_name)
    if not args.secret_path and os.environ.get(SECRET_ENV):
        path += " (from $MEMCACHE_SECRET_PATH)"
    elif not args.secret_path and args.pool_name:
        path += f" (of --pool-name {args.pool_name})"
    hint = ""
    if not args.secret_path and not args.pool_name and not os.environ.get(SECRET_ENV):
        named = named_pools()
        hint = ("; a pool with a pool_name has its own secret: pass --pool-name NAME" +
                (f" (this host has the secrets of the pools {', '.join(named)}: `memcache secrets` lists them)"
                 if named else ""))
    return (f"the admin token of the secret file {path}: it is not this pool's secret. Pass the MetaService's "
            f"auth_secret_path with --secret-path{hint}")


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]], width: int, wide: bool) -> Any:
    """A table within ``width`` columns: every column but ``host`` keeps its whole text (ids are what
    ``memcache drain`` takes); hosts get the room left and are cut with an ellipsis."""
    from rich import box
    from rich.table import Table
    from rich.text import Text
    table = Table(title=title, box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD, pad_edge=wide)
    need = {c: max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)}
    frame = 3 * len(columns) + 1                      # borders and padding, wide or not
    room = max(6, width - frame - sum(n for c, n in need.items() if c != "host"))
    for c in columns:
        left = c in ("segment", "member", "host", "tier", "last heartbeat")
        table.add_column(c, justify="left" if left else "right", no_wrap=True, overflow="ellipsis",
                         max_width=room if c == "host" else None, min_width=None if c == "host" else need[c])
    for r in rows:
        table.add_row(*(Text(cell) for cell in r))   # hosts and tiers come from members: text, never markup
    return table


def _tables(s: Snapshot, width: int) -> Any:
    """The header, the segments and the members, for a terminal ``width`` columns wide: below 100
    columns the usage bars and the segments' pid go, and hosts are shortened (never the ids)."""
    from rich.console import Group
    from rich.text import Text
    c = s.counters
    ratio = f"{100.0 * c['hits'] / c['lookups']:.1f}%" if c["lookups"] else "n/a"
    recent = [r for r in rates(s.history) if r[1] is not None]
    items = [f"role [b]{s.role}[/b]" + (f" term {s.term}" if s.term is not None else " (HA off)"),
             f"epoch {s.epoch}", f"uptime {s.uptime_s:.0f} s", f"members {len(s.members)}", f"objects {s.objects}",
             f"used {human(s.used_bytes)} / {human(s.capacity_bytes)}",
             f"hit ratio {ratio}" + (f" (last interval {100 * (recent[-1][1] or 0):.1f}%)" if recent else ""),
             f"evictions {c['evictions']}"]
    lines: list[str] = []   # lines break between items, never inside one
    for item in items:
        if lines and len(Text.from_markup(lines[-1] + "   " + item)) <= width:
            lines[-1] += "   " + item
        else:
            lines.append(item)
    head = Text.from_markup("\n".join(lines))
    wide = width >= 100

    def usage(used: int, capacity: int) -> str:
        pct = 100.0 * used / capacity if capacity else 0.0
        return (("█" * round(pct / 10) + "░" * (10 - round(pct / 10)) + " ") if wide else "") + f"{pct:5.1f}%"

    def seg_row(segment_id: int, host: str, pid: str, tier: str, objects: int, used: int, cap: int) -> tuple[str, ...]:
        return (str(segment_id), host, *((pid,) if wide else ()), tier, str(objects), human(used), human(cap),
                usage(used, cap))
    rows = [seg_row(g.segment_id, g.host_id, str(g.pid or ""), g.tier + (f" ({g.state})" if g.state else ""),
                    g.objects, g.used_bytes, g.capacity_bytes) for g in s.segments]
    owners = {g.segment_id: g for g in s.segments}
    for d in s.disk_tiers:   # a provider's disk tier, under its segment
        g_ = owners.get(d.segment_id)
        rows.append(seg_row(d.segment_id, g_.host_id if g_ else "", str(g_.pid or "") if g_ else "", "disk",
                            d.objects, d.used_bytes, d.capacity_bytes))
    segs = _table("segments", ("segment", "host") + (("pid",) if wide else ()) +
                  ("tier", "objects", "used", "capacity", "usage"), rows, width, wide)
    members = _table("members", ("member", "host", "pid", "segment", "last heartbeat"), [
        (str(m.client_id), m.host_id, str(m.pid), str(m.segment_id) if m.segment_id is not None else "client only",
         f"{m.last_seen_s:.1f} s ago") for m in s.members], width, wide)
    return Group(head, segs, members)


def status(args: argparse.Namespace) -> int:
    client = AdminClient(args)
    if args.json:   # the snapshot as the MetaService sends it, for scripts (jq) and tickets
        print(json.dumps(json.loads(client.call("/api/v1/stats")), indent=2))
        return 0
    from rich.console import Console
    from rich.live import Live
    console = Console()

    def snap() -> Snapshot:
        return msgspec.json.decode(client.call("/api/v1/stats"), type=Snapshot)
    if not args.watch:
        console.print(_tables(snap(), console.width))
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
            console.print(_tables(snap(), console.width))
            console.file.flush()
            pause()
        return 0
    with Live(_tables(snap(), console.width), console=console, auto_refresh=False) as live:
        while pause():
            live.update(_tables(snap(), console.width), refresh=True)
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

