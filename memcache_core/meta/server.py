"""The MetaService's serving loop: the control-plane FrameServer and the admin server around one
``MetaServiceCore``, housekeeping between polls, and the handler that decodes a request, runs it under
the core's lock and encodes the reply (fenced by the leader election with ``ha_enable``)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import errors, tls
from .. import protocol as p
from ..auth import SECRET_ENV, default_secret_path, load_secret
from ..config import MetaConfig, parse_url
from ..rpc import FrameServer
from ..rpc.framing import raise_fd_limit
from . import stats
from .http import AdminServer

if TYPE_CHECKING:
    from .service import MetaServiceCore

logger = logging.getLogger(__name__)


def serve(config: MetaConfig, stop: threading.Event | None = None) -> None:
    """Run the MetaService until SIGTERM/SIGINT (or ``stop`` is set)."""
    from .service import MetaServiceCore
    raise_fd_limit()
    core = MetaServiceCore(config)
    stop = stop or threading.Event()
    secret = load_secret(config.auth_secret_path, create=True, pool_name=config.pool_name) if config.auth_enable else None
    if secret is None:
        logger.warning("auth_enable is false: anyone who reaches these ports controls the pool")
    elif not (config.auth_secret_path or config.pool_name or os.environ.get(SECRET_ENV)):
        logger.info("the pool secret is %s, shared by every pool without a pool_name that this user runs "
                    "on this host; set pool_name (or auth_secret_path) to give this pool its own",
                    default_secret_path())
    handler = _handler(core)
    server = FrameServer([parse_url(config.meta_service_url, "meta_service_url", ("tcp",)),
                          parse_url(config.config_store_url, "config_store_url", ("tcp",))],
                         handler, secret, config.max_connections,
                         config.idle_timeout_seconds, tls.server_context(config),
                         keys=("meta_service_url", "config_store_url"),
                         max_per_source=config.max_connections_per_address, frame_loop=config.frame_loop)
    admin = AdminServer(core, config.metrics_url, secret, tls.server_context(config, require_client_cert=False))
    if threading.current_thread() is threading.main_thread():   # before /health answers: a SIGTERM
        for sig in (signal.SIGTERM, signal.SIGINT):               # right after it must stop cleanly
            signal.signal(sig, lambda *_: stop.set())
    admin.start()
    if core.ha is not None:
        core.ha.start()
    logger.info("MetaService (pid %d, epoch %d) serving %s, config store %s, admin %s",
                os.getpid(), core.epoch, config.meta_service_url, config.config_store_url,
                config.metrics_url)
    interval = min(config.evict_check_interval_seconds, config.heartbeat_timeout_ms / 4000.0, 1.0)
    next_house = time.monotonic() + interval
    # poll on after a request instead of sleeping; not after heartbeats alone (256 members send 256 a
    # second, each alone: the polls would cost more than the heartbeats, and nothing waits on a reply)
    spin_s, spin_until = config.poll_spin_us / 1e6, 0.0
    try:
        while not stop.is_set():
            now = time.monotonic()
            answered = core.answered
            if server.poll(0.0 if now < spin_until else max(0.0, min(next_house - now, 0.2))) \
                    and core.answered != answered:
                spin_until = time.monotonic() + spin_s
            elif now < spin_until:
                os.sched_yield()   # a busy host's other work goes first; an idle one comes straight back
            if time.monotonic() >= next_house:
                with core.lock:
                    core.housekeeping(time.monotonic())
                next_house = time.monotonic() + interval
    finally:
        if core.ha is not None:
            core.ha.stop()
        admin.stop()
        server.close()
        if core.publisher is not None:
            core.publisher.close()
        logger.info("MetaService stopped")


def _handler(core: MetaServiceCore) -> Callable[[bytes], bytes]:
    """The control-plane handler; with ha_enable, fenced by the leader election (meta/ha.py)."""
    if not core.config.ha_enable:
        return lambda body: answer(core, body)
    from . import ha
    election = ha.LeaderElection(core.config, lambda won: ha.reset(core, election, won))
    core.ha = election
    return ha.fenced(election, lambda body, term: answer(core, body, term))


def answer(core: MetaServiceCore, payload: bytes, term: int = 0) -> bytes:
    t0 = time.perf_counter()
    try:
        req = p.request_decoder.decode(payload)
    except Exception as e:  # noqa: BLE001 - a malformed message must not stop the service
        reply: p.Reply = p.Error(errors.INVALID_PARAM, f"malformed request: {e}")
        name = "malformed"
    else:
        name = type(req).__name__
    with core.lock:
        if name != "malformed":
            try:
                reply = core.handle(req)
            except errors.MemCacheError as e:
                reply = p.Error(e.code, str(e))
            except Exception as e:  # noqa: BLE001 - a handler's bug is an error reply, never the end
                logger.exception("request %s failed", name)
                reply = p.Error(errors.ERROR, f"{type(e).__name__}: {e}")
            if type(reply) is not p.HeartbeatReply:   # (no outcome of a heartbeat is counted)
                core.answered += 1
                stats.count_outcomes(core.outcomes, req, reply)
        core.metrics.observe(name, time.perf_counter() - t0, failed=isinstance(reply, p.Error))
    reply.term = term
    try:
        return p.request_encoder.encode(reply)
    except Exception as e:  # noqa: BLE001 - an unencodable reply must not stop the service
        logger.exception("reply to %s could not be encoded", name)
        return p.request_encoder.encode(p.Error(errors.ERROR, f"reply could not be encoded: {e}", term=term))
