"""Ascend protocols go through MemFabric (``memfabric-hybrid``), which exists only on Ascend hosts."""

from __future__ import annotations

from ..errors import UnsupportedProtocol


def require_memfabric(protocol: str) -> None:
    try:
        import memfabric_hybrid  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        raise UnsupportedProtocol(
            f"protocol: {protocol!r} needs MemFabric (memfabric-hybrid) on Ascend hardware, which is not "
            f"available here; use 'host_shm' (same host) or 'host_tcp' (across hosts)") from None
    raise UnsupportedProtocol(
        f"protocol: {protocol!r}: MemFabric transfers are not implemented yet; use 'host_shm' or 'host_tcp'")
