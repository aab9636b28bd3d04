"""The ``memcache`` command: ``memcache meta-service --config_path F``, ``memcache local-service --config_path F``;
``memcache status [--watch | --json]``, ``memcache keys --prefix P``, ``memcache remove --prefix P``,
``memcache drain SEGMENT``, ``memcache token`` (cli_status.py); ``memcache secrets``, ``memcache forget-pool
--pool-name X`` (cli_secrets.py)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .config import LocalConfig, load_file
from .errors import MemCacheError
from .logs import configure_logging

logger = logging.getLogger(__name__)


def _local_service(path: str) -> int:
    from .local.service import LocalService
    # SIGTERM / SIGINT are taken before the start: one that comes while it starts (it may already have
    # joined) stops the start where it is, closes what was made and exits 0; one that comes after
    # closes it as usual. Never the default action, which killed a provider that had just joined.
    stop, starting = threading.Event(), [True]
    refused: list[MemCacheError] = []   # the wait for the pool ended for good (a wrong secret)

    def on_signal(*_: object) -> None:
        stop.set()
        if starting[0]:
            raise SystemExit(0)   # in the main thread, out of ``start``, whose failure path closes

    def on_refused(e: MemCacheError) -> None:
        refused.append(e)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        config = load_file(LocalConfig, path)
        configure_logging(config.log_level, name="local_service")
        if config.segment_prefault == "auto":
            config.segment_prefault = "on"   # a provider's segment is the pool: fault it in at start
        svc = LocalService(config)
        # its metrics are a provider's only view; a MetaService not up yet is waited for (applied at once
        # with it, a provider must not crash-loop until it is ready), a refusal for good is not
        svc.start(0, with_segment=True, metrics_required=True, wait_for_pool=True, on_join_failed=on_refused)
        starting[0] = False
    except (MemCacheError, OSError) as e:   # one line naming the setting, never a traceback
        configure_logging("info")
        logger.error("LocalService cannot start: %s", e)
        return 1
    if svc.joined:
        logger.info("LocalService %d serving %d bytes (%s)", svc.client_id, config.dram_bytes, config.protocol)
    else:
        logger.info("LocalService holds %d bytes (%s) and joins the pool when the MetaService answers",
                    config.dram_bytes, config.protocol)
    stop.wait()
    svc.close()
    return 1 if refused else 0   # (the LocalService logged why it stopped waiting)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memcache", description="MemCache for Python")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("meta-service", "run the MetaService"),
                        ("local-service", "run a standalone LocalService (memory provider)")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--config_path", "--config-path", required=True, help="JSON config file")
    from . import cli_secrets, cli_status
    cli_status.add_parsers(sub)
    cli_secrets.add_parsers(sub)
    args = ap.parse_args(argv)
    if args.cmd in ("status", "keys", "remove", "drain", "token"):
        return int(getattr(cli_status, args.cmd)(args))
    if args.cmd in ("secrets", "forget-pool"):
        return int(getattr(cli_secrets, args.cmd.replace("-", "_"))(args))
    if args.cmd == "meta-service":
        from .meta_service import run_from_file
        return run_from_file(args.config_path)
    return _local_service(args.config_path)


if __name__ == "__main__":
    sys.exit(main())
