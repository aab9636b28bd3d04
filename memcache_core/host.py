"""This host, as the data paths see it: its identity (segments on the same host are mapped through
shared memory) and where shared-memory segments are created."""

from __future__ import annotations

import os


def env_host_id() -> str:
    """The host identity used to decide whether a segment can be mapped through shared memory."""
    override = os.environ.get("MEMCACHE_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


def shm_dir() -> str:
    """Where shared-memory segments are created (POSIX shared memory on Linux)."""
    return os.environ.get("MEMCACHE_SHM_DIR", "/dev/shm")
