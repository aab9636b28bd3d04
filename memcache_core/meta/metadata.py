"""The admin route ``/metadata?key=`` (memcache_hybrid's): a small store of text values an operator's
tools keep beside the pool, held by the MetaService (``service.py``) and served by ``http.py``; and
the error answers every memcache_hybrid route gives (``ascend_http.py``)."""

from __future__ import annotations

import time
from typing import Any

MAX_METADATA_KEYS = 1024        # entries kept
MAX_METADATA_VALUE = 64 << 10   # bytes of one value
MAX_METADATA_KEY = 256          # bytes of one key


def timestamp() -> int:
    return int(time.time())


def error(msg: str) -> dict[str, Any]:
    """An error answer as memcache_hybrid's admin routes give it (HTTP 200)."""
    return {"error_message": msg, "success": False, "timestamp": timestamp()}


def missing(name: str) -> dict[str, Any]:
    return error(f"Missing '{name}' parameter")


class Metadata:
    """``/metadata?key=``: a small store of text values an operator's tools keep beside the pool (GET,
    PUT with the value as the body, DELETE), bounded: ``MAX_METADATA_KEYS`` entries of at most
    ``MAX_METADATA_VALUE`` bytes, keys of at most ``MAX_METADATA_KEY``. Held in memory, like the rest
    of the MetaService's state (it does not survive a restart)."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def handle(self, method: str, q: dict[str, str], body: bytes | None) -> dict[str, Any]:
        if "key" not in q:
            return missing("key")
        key = q["key"]
        if not key or len(key.encode()) > MAX_METADATA_KEY:
            return error(f"key: expected 1 to {MAX_METADATA_KEY} bytes")
        if method == "GET":
            if key not in self.values:
                return error("Metadata key not found")
            return {"key": key, "success": True, "timestamp": timestamp(), "value": self.values[key]}
        if method == "DELETE":
            if self.values.pop(key, None) is None:
                return error("Metadata key not found")
            return {"key": key, "success": True, "timestamp": timestamp()}
        value = (body or b"").decode("utf-8", errors="replace")
        if len(body or b"") > MAX_METADATA_VALUE:
            return error(f"value: at most {MAX_METADATA_VALUE} bytes")
        if key not in self.values and len(self.values) >= MAX_METADATA_KEYS:
            return error(f"metadata: at most {MAX_METADATA_KEYS} keys; delete one first")
        self.values[key] = value
        return {"key": key, "success": True, "timestamp": timestamp()}
