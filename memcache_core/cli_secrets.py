"""``memcache secrets`` and ``memcache forget-pool --pool-name NAME``: the pool secret files this user
holds, and the removal of one pool's.

A MetaService with a ``pool_name`` creates ``~/.config/memcache/pool-<pool_name>.secret`` when it is
missing (``secret_file.py``); nothing else removes it. ``memcache secrets`` lists these files with
their pool names and modification times. ``memcache forget-pool`` removes one pool's file after
making sure that no MetaService of that pool answers at its address (``meta_service_url`` of
``--config_path``, else ``--meta-service-url``): it connects there and offers the pool's secret. A
server that proves it holds that secret is the pool's MetaService (refused); one that refuses the
secret is another pool's, and nothing listening is nothing; anything else (no challenge, a reset) is
refused as undecided. Disk records written under a removed secret are unreadable afterwards: a pool
started again under the name gets a new secret, and its disk tiers drop the old records as foreign.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any

from .auth import AuthFailed, AuthMismatch, client_handshake
from .errors import ConfigError
from .secret_file import SECRET_ENV, load_secret, pool_secret_file, secret_folder
from .values import check_cluster_id, parse_meta_target, parse_url

DEFAULT_META_SERVICE_URL = "tcp://127.0.0.1:5000"
PROBE_TIMEOUT_S = 3.0


def add_parsers(sub: Any) -> None:
    sub.add_parser("secrets", help="list this user's pool secret files (~/.config/memcache), with their pool names")
    sp = sub.add_parser("forget-pool", help="remove a pool's secret file, once no MetaService of that pool answers")
    sp.add_argument("--pool-name", default=os.environ.get("MEMCACHE_POOL_NAME", ""),
                    help="the pool's pool_name ($MEMCACHE_POOL_NAME; default: the one in --config_path)")
    sp.add_argument("--config_path", "--config-path", default="",
                    help="the pool's JSON file: its meta_service_url, pool_name and tls_* settings are used")
    sp.add_argument("--meta-service-url", default="",
                    help=f"where the pool's MetaService would answer (default: the file's, else "
                         f"{DEFAULT_META_SERVICE_URL}); several, comma-separated, are all asked")
    sp.add_argument("--force", action="store_true",
                    help="remove the file without asking the MetaService's address (its host is gone)")


def named_pools() -> list[str]:
    """The pool names whose default secret files (``pool-<name>.secret``) this user has."""
    return [name for name, _ in _secret_files() if name]


def _secret_files() -> list[tuple[str, str]]:
    """(pool name, "" for the unnamed pools' file; path) of the secret files in ``secret_folder()``."""
    try:
        names = sorted(os.listdir(secret_folder()))
    except OSError:
        return []
    out = [("", pool_secret_file())] if "pool.secret" in names else []
    return out + [(n[len("pool-"):-len(".secret")], os.path.join(secret_folder(), n)) for n in names
                  if n.startswith("pool-") and n.endswith(".secret") and len(n) > len("pool-.secret")]


def secrets(args: argparse.Namespace) -> int:
    files = _secret_files()
    if not files:
        print(f"no pool secret files in {secret_folder()}")
    else:
        rows = [("pool", "modified (UTC)", "file")]
        for name, path in files:
            try:
                mtime = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(os.lstat(path).st_mtime))
            except OSError:
                mtime = "?"
            rows.append((name or "(no pool_name)", mtime, path))
        width = max(len(r[0]) for r in rows)
        for r in rows:
            print(f"{r[0]:<{width}}  {r[1]:<19}  {r[2]}")
    if os.environ.get(SECRET_ENV):
        print(f"note: ${SECRET_ENV} is set ({os.environ[SECRET_ENV]}): processes started with it use that "
              f"file instead of these", file=sys.stderr)
    return 0


def forget_pool(args: argparse.Namespace) -> int:
    config: Any = None
    try:
        if args.config_path:
            from .config import LocalConfig, load_file
            config = load_file(LocalConfig, args.config_path)
        name = args.pool_name or (config.pool_name if config is not None else "")
        if not name:
            raise ConfigError("--pool-name: name the pool whose secret file to remove (its pool_name); "
                              "`memcache secrets` lists them")
        check_cluster_id(name, "--pool-name")
        path = pool_secret_file(name)
        if not os.path.lexists(path):
            raise ConfigError(f"--pool-name: no secret file of the pool {name!r} ({path}); `memcache secrets` "
                              f"lists this user's")
        url = args.meta_service_url or (config.meta_service_url if config is not None else DEFAULT_META_SERVICE_URL)
        if not args.force:
            _refuse_if_served(name, path, url, config)
    except ConfigError as e:
        print(f"memcache: forget-pool: {e}", file=sys.stderr)
        return 1
    try:
        os.unlink(path)
    except OSError as e:
        print(f"memcache: forget-pool: cannot remove {path}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"removed {path}, the secret of the pool {name!r}. Disk records written under it can no longer be "
          f"read (a MetaService started again as {name!r} makes a new secret, and its disk tiers drop the "
          f"old records); copies of the file on other hosts are left as they are")
    return 0


def _refuse_if_served(name: str, path: str, url: str, config: Any) -> None:
    """ConfigError unless, at every address of ``url``, nothing listens or a MetaService of another pool
    (one that refuses this pool's secret) does."""
    target = parse_meta_target(url, "--meta-service-url")
    if target.etcd:
        raise ConfigError(f"--meta-service-url: {url} names the MetaServices through etcd; pass their tcp:// "
                          f"addresses (comma-separated) to check that none of them serves the pool {name!r}")
    secret = load_secret(path)
    from . import tls
    ctx = tls.client_context(config) if config is not None else None
    for u in target.urls:
        addr = parse_url(u, "--meta-service-url", ("tcp",))
        why = _probe(addr, secret, ctx)
        if why:
            raise ConfigError(f"{u}: {why}; the secret file {path} of the pool {name!r} is still needed, not "
                              f"removed. Stop that MetaService first (or pass --meta-service-url of the pool's "
                              f"MetaService; --force skips this check)")


def _probe(addr: tuple[str, int], secret: bytes, ctx: Any) -> str:
    """Why ``addr`` may be the pool's MetaService ("" when it is not): the handshake with its secret."""
    try:
        sock = socket.create_connection(addr, timeout=PROBE_TIMEOUT_S)
    except OSError:
        return ""   # nothing listens there
    try:
        if ctx is not None:
            sock = ctx.wrap_socket(sock)
        client_handshake(sock, secret, PROBE_TIMEOUT_S)
    except AuthMismatch:
        return ""   # a server of another secret: another pool's
    except (AuthFailed, OSError) as e:   # no challenge (auth_enable false, TLS expected), a reset, a TLS failure
        why = "no authentication challenge" if "no authentication challenge" in str(e) else f"{type(e).__name__}: {e}"
        return (f"something listens there that did not refuse this pool's secret ({why}), so it could be this "
                f"pool's MetaService (with auth_enable false, or TLS: give --config_path with the pool's tls_* keys)")
    finally:
        sock.close()
    return "a MetaService of this pool answers there (it proved it holds the pool's secret)"
