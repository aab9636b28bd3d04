"""Namespace-scoped removal for ``clear()``: list the pool's keys and remove those of one namespace.

The listing comes from the MetaService's HTTP admin API (``GET {metrics_url}/get_all_keys``);
removal goes through the store (``remove_batch``), so objects being read under a lease are
handled by the pool's own rules.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any

logger = logging.getLogger(__name__)

REMOVE_CHUNK = 1000
HTTP_TIMEOUT_S = 10.0


def list_keys(metrics_url: str) -> list[str]:
    with urllib.request.urlopen(metrics_url.rstrip("/") + "/get_all_keys", timeout=HTTP_TIMEOUT_S) as resp:
        data = json.loads(resp.read().decode())
    if isinstance(data, dict):
        for field in ("keys", "data", "result"):
            if isinstance(data.get(field), list):
                data = data[field]
                break
    if not isinstance(data, list):
        raise ValueError(f"unexpected /get_all_keys answer: {type(data).__name__}")
    return [k if isinstance(k, str) else str(k.get("key")) for k in data]


def remove_namespace(store: Any, prefix: str, metrics_url: str | None) -> int | None:
    """Remove every object whose key starts with ``prefix``; ``None`` if keys cannot be listed."""
    if not metrics_url:
        return None
    try:
        keys = [k for k in list_keys(metrics_url) if k.startswith(prefix)]
    except Exception as exc:
        logger.warning("cannot list the pool's keys at %s: %s", metrics_url, exc)
        return None
    for start in range(0, len(keys), REMOVE_CHUNK):
        store.remove_batch(keys[start:start + REMOVE_CHUNK])
    return len(keys)
