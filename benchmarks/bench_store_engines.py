"""``bench_store.py``'s engine adapters, run inside the worker processes: memcache_core's
DistributedObjectStore and Mooncake Store's MooncakeDistributedStore behind the same calls."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from bench_store_common import SEGMENT, BenchError, free_port, load_bench_nixl

# ---- engine adapters (run inside the worker processes) ----------------------------------------------

class Layers(list[list[tuple[int, int]]]):
    """A batch's pieces, (pointer, size) per piece per object, with the pointer and size lists the
    stores' calls take built once, before any clock starts (they are the caller's work)."""

    def __init__(self, pieces: Iterable[list[tuple[int, int]]]) -> None:
        super().__init__(pieces)
        self.lists = _split(self)


def _lists(pieces: list[list[tuple[int, int]]]) -> tuple[list[list[int]], list[list[int]]]:
    return pieces.lists if isinstance(pieces, Layers) else _split(pieces)


def _split(pieces: list[list[tuple[int, int]]]) -> tuple[list[list[int]], list[list[int]]]:
    return [[p for p, _ in ps] for ps in pieces], [[s for _, s in ps] for ps in pieces]


class CoreClient:
    """memcache_core's DistributedObjectStore."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from memcache_core import DistributedObjectStore, LocalConfig, ReplicateConfig
        cfg = LocalConfig()
        cfg.meta_service_url = spec["meta_service_url"]
        cfg.config_store_url = spec["config_store_url"]
        load_bench_nixl().configure(cfg, spec["protocol"])
        cfg.dram_size = SEGMENT
        cfg.log_level = "warning"
        cfg.hcom_url = "tcp://127.0.0.1:0"
        cfg.checksum = spec.get("checksum", True)
        cfg.auth_enable = spec.get("auth", True)
        if spec.get("rpc_spin_us") is not None:
            cfg.rpc_spin_us = spec["rpc_spin_us"]
        if spec.get("data_server_loop") is not None:
            cfg.data_server_loop = spec["data_server_loop"]
        self._rc = ReplicateConfig
        self.store = DistributedObjectStore()
        if self.store.setup(cfg) != 0 or self.store.init(0, init_bm=True) != 0:
            raise BenchError("LocalService did not start")
        self.ident = self.store.get_local_service_id()

    def register(self, ptr: int, size: int) -> None:
        if self.store.register_buffer(ptr, size) != 0:
            raise BenchError("register_buffer failed")

    def set_checksum(self, on: bool) -> None:
        """Checksums on or off for this process's next puts (computed) and gets (verified)."""
        cfg = self.store._service().config
        cfg.checksum, cfg.checksum_verify_ratio = on, 1.0 if on else 0.0

    def put(self, keys: list[str], pieces: list[list[tuple[int, int]]], peer: Any, replicas: int = 1) -> list[int]:
        rc = None
        if peer is not None or replicas != 1:
            rc = self._rc(replicas)
            rc.preferredLocalServiceIDs = [peer] if peer is not None else []
        return self.store.batch_put_from_layers(keys, *_lists(pieces), replicateConfig=rc)

    def get(self, keys: list[str], pieces: list[list[tuple[int, int]]]) -> list[int]:
        return self.store.batch_get_into_layers(keys, *_lists(pieces))

    def put1(self, key: str, ptr: int, size: int) -> int:
        return self.store.put_from(key, ptr, size)

    def paths(self) -> dict[str, float]:
        """Payload bytes moved so far per transfer path and direction (e.g. ``nixl/read``)."""
        reg = self.store._service().metrics.registry
        return {f"{x.labels['path']}/{x.labels['direction']}": x.value for m in reg.collect()
                if m.name == "memcache_local_transfer_bytes" for x in m.samples if x.name.endswith("_total")}

    def get1(self, key: str, ptr: int, size: int) -> int:
        return self.store.get_into(key, ptr, size)

    def exist1(self, key: str) -> int:
        return self.store.is_exist(key)

    def exist(self, keys: list[str]) -> list[int]:
        return self.store.batch_is_exist(keys)

    def remove(self, keys: list[str]) -> None:
        self.store.remove_batch(keys)

    def close(self) -> None:
        self.store.close()


class MooncakeClient:
    """Mooncake Store's MooncakeDistributedStore over its TCP transport (its only CPU transport)."""

    def set_checksum(self, on: bool) -> None:
        """Mooncake Store has no payload checksums: there is nothing to switch."""

    def __init__(self, spec: dict[str, Any]) -> None:
        # its servers on loopback: the client's RPC port on local_hostname's address (127.0.0.1) rather
        # than every address, and the TCP transport's listening socket (benchmarks/README.md, Mooncake)
        os.environ.setdefault("MC_LEGACY_RPC_PORT_BINDING", "1")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        self._rc = ReplicateConfig
        self.store = MooncakeDistributedStore()
        self.ident = f"127.0.0.1:{free_port()}"
        rc = self.store.setup(self.ident, spec["metadata_url"], SEGMENT, 64 << 20, "tcp", "",
                              spec["master_addr"])
        if rc != 0:
            raise BenchError(f"Mooncake setup failed ({rc})")

    def register(self, ptr: int, size: int) -> None:
        if self.store.register_buffer(ptr, size) != 0:
            raise BenchError("register_buffer failed")

    def _config(self, segment: str | None, replicas: int = 1) -> Any:
        rc = self._rc()
        rc.replica_num = replicas
        rc.preferred_segment = segment or self.ident
        return rc

    def put(self, keys: list[str], pieces: list[list[tuple[int, int]]], peer: Any, replicas: int = 1) -> list[int]:
        cfg = self._config(peer, replicas)
        ptrs, sizes = _lists(pieces)
        if all(len(ps) == 1 for ps in pieces):
            return self.store.batch_put_from(keys, [p[0] for p in ptrs], [s[0] for s in sizes], cfg)
        return self.store.batch_put_from_multi_buffers(keys, ptrs, sizes, cfg)

    def get(self, keys: list[str], pieces: list[list[tuple[int, int]]]) -> list[int]:
        ptrs, sizes = _lists(pieces)
        if all(len(ps) == 1 for ps in pieces):
            got = self.store.batch_get_into(keys, [p[0] for p in ptrs], [s[0] for s in sizes])
        else:
            got = self.store.batch_get_into_multi_buffers(keys, ptrs, sizes)
        return [0 if g == sum(s for _, s in ps) else (g if g < 0 else -1) for g, ps in zip(got, pieces, strict=True)]

    def put1(self, key: str, ptr: int, size: int) -> int:
        return self.store.put_from(key, ptr, size, self._config(None))

    def paths(self) -> dict[str, float]:
        """Mooncake Store does not say which path its bytes took."""
        return {}

    def get1(self, key: str, ptr: int, size: int) -> int:
        got = self.store.get_into(key, ptr, size)
        return 0 if got == size else -1

    def exist1(self, key: str) -> int:
        return self.store.is_exist(key)

    def exist(self, keys: list[str]) -> list[int]:
        return self.store.batch_is_exist(keys)

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            self.store.remove(k, True)

    def close(self) -> None:
        self.store.close()


def moved(before: dict[str, float], after: dict[str, float], direction: str) -> list[str]:
    """The transfer paths that moved bytes in ``direction`` between two ``paths()`` readings."""
    return sorted(k.split("/")[0] for k, v in after.items()
                  if k.endswith("/" + direction) and v > before.get(k, 0))
