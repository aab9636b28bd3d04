"""``bench_store.py --transfer-engine nixl``: the NIXL (UCX) data plane beside the built-in TCP path.

The figures' ``protocol`` column reads ``nixl``: both LocalServices run ``transfer_engine: "nixl"``
with distinct host ids (so each is the other's remote host: gets and puts to the peer's segment are
one-sided NIXL requests, not shared memory); the built-in ``host_tcp`` rows come from the same run.
UCX is pinned to its tcp transport on loopback unless the environment already says otherwise (this
machine has no RDMA card; on one, set ``UCX_TLS=rc,...`` and ``UCX_NET_DEVICES=mlx5_0:1`` instead:
docs/nixl.md); the transport's own UCX defaults (``memcache_core/transfer/nixl_agent.py``) apply.
"""

from __future__ import annotations

import os
import sys
from typing import Any

PROTOCOL = "nixl"
UCX_LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def prepare(protocol_arg: str) -> list[str] | None:
    """The protocols of a ``--transfer-engine nixl`` run (None: nixl is not importable, said on stderr).
    Sets the UCX defaults in this process's environment; the spawned workers inherit them."""
    from memcache_core.transfer.nixl import INSTALL, available
    from memcache_core.transfer.nixl_agent import ucx_settings
    if not available():
        print(f"--transfer-engine nixl: nixl is not importable in {sys.executable}; {INSTALL}", file=sys.stderr)
        return None
    for k, v in UCX_LOOPBACK.items():
        os.environ.setdefault(k, v)
    print("UCX: " + " ".join(f"UCX_{k}={v}" for k, v in sorted(ucx_settings().items())), flush=True)
    builtin = ["host_tcp"] if protocol_arg == "all" else [protocol_arg]
    return builtin + [PROTOCOL]


def configure(cfg: Any, protocol: str) -> None:
    """A worker's LocalConfig for a ``nixl`` row: its own host id, the NIXL engine."""
    if protocol == PROTOCOL:
        cfg.protocol = "host_tcp"
        cfg.transfer_engine = "nixl"
        cfg.host_id = f"bench-host-{os.getpid()}"
    else:
        cfg.protocol = protocol
