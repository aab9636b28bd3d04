"""Logging for the processes this package runs itself (never called on import: a library installs no handlers)."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys


def configure_logging(level: str = "info", log_path: str = "", name: str = "memcache",
                      rotate_mb: int = 20, keep: int = 50, stdout: bool = False) -> None:
    """Log to stderr (stdout with ``stdout``), or to ``<log_path>/<name>.log`` rotated every ``rotate_mb``
    MB keeping ``keep`` old files."""
    lvl = {"warn": "WARNING"}.get(level.lower(), level.upper())
    handler: logging.Handler
    if log_path:
        os.makedirs(log_path, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(os.path.join(log_path, f"{name}.log"),
                                                       maxBytes=rotate_mb << 20, backupCount=keep)
    else:
        handler = logging.StreamHandler(sys.stdout if stdout else sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
