"""Optional TLS for the control, config-store, data and admin planes (``tls_enable``).

The pool's authentication (``auth.py``) proves every connection holds the pool secret; TLS adds
encryption and, with mutual certificates, a second proof of membership. Every member uses a
certificate signed by the pool's CA (``tls_ca_path``): servers require client certificates on the
control and data planes and clients verify the server's chain. Host names are not checked (pools are
addressed by IP; the CA is the pool's own). The admin HTTP server speaks HTTPS with the same
certificate and does not ask for a client certificate (its routes take the admin bearer token).
Same-host shared-memory copies do not touch the network and are not affected.
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from typing import Any

from .errors import ConfigError


def _files(cfg: Any) -> tuple[str, str, str]:
    return cfg.tls_ca_path, cfg.tls_cert_path, cfg.tls_key_path


def _context(cfg: Any, protocol: int) -> ssl.SSLContext | None:
    """A TLS 1.2+ context holding the pool's CA and this member's certificate; None without
    ``tls_enable``."""
    if not cfg.tls_enable:
        return None
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, *_files(cfg))
    return ctx


def server_context(cfg: Any, require_client_cert: bool = True) -> ssl.SSLContext | None:
    """The server-side context of a config with ``tls_enable``, else None."""
    ctx = _context(cfg, ssl.PROTOCOL_TLS_SERVER)
    if ctx is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
    return ctx


def client_context(cfg: Any) -> ssl.SSLContext | None:
    """The client-side context of a config with ``tls_enable`` (the server's chain is verified, its
    host name is not), else None."""
    ctx = _context(cfg, ssl.PROTOCOL_TLS_CLIENT)
    if ctx is not None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _load(ctx: ssl.SSLContext, ca: str, cert: str, key: str) -> None:
    try:
        ctx.load_verify_locations(ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"tls_ca_path: cannot load {ca!r}: {e}") from e
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"tls_cert_path/tls_key_path: cannot load {cert!r} with {key!r}: {e}") from e


def check(cfg: Any) -> None:
    """Validate the TLS keys of a config (called from its ``validate``)."""
    if not isinstance(cfg.tls_enable, bool):
        raise ConfigError(f"tls_enable: expected true or false, got {cfg.tls_enable!r}")
    if cfg.tls_enable:
        for key in ("tls_ca_path", "tls_cert_path", "tls_key_path"):
            if not isinstance(getattr(cfg, key), str) or not getattr(cfg, key):
                raise ConfigError(f"{key}: required when tls_enable is true")


def tls_handshake(conn: ssl.SSLSocket, deadline: float) -> bool:
    """A server-side TLS handshake that ends by ``deadline`` (monotonic), however the peer trickles."""
    conn.setblocking(False)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            this: list[socket.socket] = [conn]
            none: list[socket.socket] = []
            try:
                conn.do_handshake()
                return True
            except ssl.SSLWantReadError:
                ready = select.select(this, none, none, left)
            except ssl.SSLWantWriteError:
                ready = select.select(none, this, none, left)
            if not any(ready):
                return False
    except (ssl.SSLError, OSError):
        return False
    finally:
        conn.setblocking(True)
