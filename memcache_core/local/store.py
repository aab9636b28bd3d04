"""``DistributedObjectStore``: the memcache_hybrid-compatible API, the one place exceptions become codes.

Argument order, defaults and return codes follow memcache_hybrid 1.3.0: 0 is success, batch calls
return one code per key, ``batch_get_into`` returns 0 per key on success, ``is_exist`` 1/0, ``get``
returns b"" when the key is absent. Pointer arguments must lie inside buffers given to
``register_buffer``; anything else is refused with -3000 before it is touched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from .. import errors
from ..config import LocalConfig, local_config_from_env
from ..errors import InvalidParameter, MemCacheError, NotInitialized
from .buffers import BufferRegistry, buffer_address
from .service import LocalService
from .store_codes import DIRECTIONS, G2H, H2G, KeyInfo, as_code, code_of, codes_of, int_arg, replication

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DistributedObjectStore:
    def __init__(self) -> None:
        self._config: LocalConfig | None = None
        self._svc: LocalService | None = None
        self._buffers = BufferRegistry()
        self._pure_client = False

    # ---- lifecycle -------------------------------------------------------------------------------

    def setup(self, config: LocalConfig | None = None) -> int:
        try:
            cfg = config if config is not None else local_config_from_env()
            cfg.validate()
            if cfg.protocol not in ("host_shm", "host_tcp"):
                from ..transfer.memfabric import require_memfabric
                require_memfabric(cfg.protocol)
        except MemCacheError as e:
            logger.error("setup failed: %s", e)
            return e.code
        self._config = cfg
        logging.getLogger("memcache_core").setLevel({"warn": "WARNING"}.get(cfg.log_level.lower(),
                                                                             cfg.log_level.upper()))
        return errors.SUCCESS

    def init(self, device_id: int = 0, init_bm: bool = True) -> int:
        if self._config is None:
            rc = self.setup()
            if rc != 0:
                return rc
        if self._svc is not None:
            return errors.REPEATED_CALL
        assert self._config is not None
        try:
            svc = LocalService(self._config)
            svc.start(int(device_id), with_segment=bool(init_bm))
            for ptr, size in self._buffers.regions():
                svc.register_memory(ptr, size)
        except MemCacheError as e:
            logger.error("init failed: %s", e)
            return e.code
        except OSError as e:
            logger.error("init failed: cannot create the segment or data server: %s", e)
            return errors.MALLOC_FAILED
        self._svc = svc
        self._pure_client = not init_bm
        return errors.SUCCESS

    def close(self) -> int:
        svc, self._svc = self._svc, None
        if svc is not None:
            svc.close()
        return errors.SUCCESS

    def get_local_service_id(self) -> int:
        return self._svc.client_id if self._svc is not None else errors.NOT_INITIALIZED

    def _service(self) -> LocalService:
        if self._svc is None:
            raise NotInitialized("DistributedObjectStore is not initialized: call setup() and init() first")
        return self._svc

    # ---- buffers ---------------------------------------------------------------------------------

    def register_buffer(self, ptr: int, size: int) -> int:
        try:
            self._buffers.register(ptr, size)
            if self._svc is not None:
                self._svc.register_memory(ptr, size)
        except MemCacheError as e:
            logger.warning("register_buffer refused: %s", e)
            return e.code
        return errors.SUCCESS

    def unregister_buffer(self, ptr: int, size: int) -> int:
        try:
            self._buffers.unregister(ptr, size)
            if self._svc is not None:
                self._svc.unregister_memory(ptr, size)
        except MemCacheError as e:
            logger.warning("unregister_buffer refused: %s", e)
            return e.code
        return errors.SUCCESS

    def _checked(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
                 ) -> tuple[list[list[tuple[int, int]]], list[MemCacheError | None]]:
        if not (len(keys) == len(ptrs) == len(sizes)):
            raise InvalidParameter(f"keys ({len(keys)}), pointers ({len(ptrs)}) and sizes ({len(sizes)}) "
                                   f"differ in length")
        pieces: list[list[tuple[int, int]]] = []
        errs: list[MemCacheError | None] = []
        for ps, ss in zip(ptrs, sizes, strict=True):
            try:
                pieces.append(self._buffers.pieces(ps, ss))
                errs.append(None)
            except InvalidParameter as e:
                pieces.append([])
                errs.append(e)
        return pieces, errs

    # ---- put ---------------------------------------------------------------------------------------

    def _put(self, keys: Sequence[str], pieces: list[list[tuple[int, int]]], errs: list[MemCacheError | None],
             rc: Any) -> list[int]:
        replicas, preferred = replication(rc)
        ok = [i for i, e in enumerate(errs) if e is None]
        res = self._service().put([keys[i] for i in ok], [pieces[i] for i in ok], replicas, preferred)
        for i, e in zip(ok, res, strict=True):
            errs[i] = e
        return [as_code(e) for e in errs]

    def batch_put_from_layers(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
                              direct: int = H2G, replicateConfig: Any = None) -> list[int]:  # noqa: N803
        def run() -> list[int]:
            pieces, errs = self._checked(keys, ptrs, sizes)
            return self._put(keys, pieces, errs, replicateConfig)
        return codes_of(len(keys), run)

    def put_from_layers(self, key: str, ptrs: list[int], sizes: list[int], direct: int = H2G,
                        replicateConfig: Any = None) -> int:  # noqa: N803
        return self.batch_put_from_layers([key], [ptrs], [sizes], direct, replicateConfig)[0]

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int], direct: int = H2G,
                       replicateConfig: Any = None) -> list[int]:  # noqa: N803
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [errors.INVALID_PARAM] * len(keys)
        return self.batch_put_from_layers(keys, [[x] for x in ptrs], [[s] for s in sizes], direct,
                                          replicateConfig)

    def put_from(self, key: str, ptr: int, size: int, direct: int = H2G, replicateConfig: Any = None) -> int:  # noqa: N803
        return self.batch_put_from_layers([key], [[ptr]], [[size]], direct, replicateConfig)[0]

    def put_batch(self, keys: list[str], values: list[Any], replicateConfig: Any = None) -> int:  # noqa: N803
        def run() -> int:
            if len(keys) != len(values):
                raise InvalidParameter("keys and values differ in length")
            pieces, keep = [], []
            for v in values:
                addr, n, anchor = buffer_address(v)
                if n == 0:
                    raise InvalidParameter("a value is empty")
                pieces.append([(addr, n)])
                keep.append(anchor)
            codes = self._put(keys, pieces, [None] * len(keys), replicateConfig)
            return next((c for c in codes if c != 0), 0)
        return code_of(run)

    def put(self, key: str, buf: Any, replicateConfig: Any = None) -> int:  # noqa: N803
        return self.put_batch([key], [buf], replicateConfig)

    # ---- get ---------------------------------------------------------------------------------------

    def batch_get_into_layers(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
                              direct: int = G2H) -> list[int]:
        def run() -> list[int]:
            pieces, errs = self._checked(keys, ptrs, sizes)
            ok = [i for i, e in enumerate(errs) if e is None]
            res, _ = self._service().get([keys[i] for i in ok], [pieces[i] for i in ok])
            for i, e in zip(ok, res, strict=True):
                errs[i] = e
            return [as_code(e) for e in errs]
        return codes_of(len(keys), run)

    def get_into_layers(self, key: str, ptrs: list[int], sizes: list[int], direct: int = G2H) -> int:
        return self.batch_get_into_layers([key], [ptrs], [sizes], direct)[0]

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int], direct: int = G2H) -> list[int]:
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [errors.INVALID_PARAM] * len(keys)
        return self.batch_get_into_layers(keys, [[x] for x in ptrs], [[s] for s in sizes], direct)

    def get_into(self, key: str, ptr: int, size: int, direct: int = G2H) -> int:
        return self.batch_get_into_layers([key], [[ptr]], [[size]], direct)[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Each key's bytes, b"" where it is missing or could not be read (one ``Lookup`` for all)."""
        try:
            res, bufs = self._service().get_new(keys)
        except (MemCacheError, TypeError, ValueError) as e:
            logger.debug("get_batch failed: %s", e)
            return [b""] * len(keys)
        return [bytes(b) if e is None else b"" for e, b in zip(res, bufs, strict=True)]

    def get(self, key: str) -> bytes:
        return self.get_batch([key])[0]

    # ---- exist / remove / info ----------------------------------------------------------------------

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return codes_of(len(keys), lambda: list(map(int, self._service().exist(keys))))

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def remove_batch(self, keys: list[str]) -> list[int]:
        return codes_of(len(keys), lambda: self._service().remove(keys))

    def remove(self, key: str) -> int:
        return self.remove_batch([key])[0]

    def remove_by_prefix(self, prefix: str) -> int:
        """Remove every committed object whose key starts with ``prefix`` (a tenant's namespace) in one
        call. Returns how many were removed, or a negative code. Not in memcache_hybrid's API."""
        return code_of(lambda: self._service().remove_prefix(prefix))

    def remove_all(self) -> int:
        def run() -> int:
            self._service().remove_all()
            return errors.SUCCESS
        return code_of(run)

    # ---- tiers ----------------------------------------------------------------------------------------

    def prefetch(self, keys: list[str], src_media: Any = None, dst_media: Any = None, flags: int = 0) -> list[int]:
        """Bring objects a provider holds on its disk tier back into DRAM ahead of reading them: a code
        per key (0 in DRAM, -3007 not in the pool). The media and flags arguments are accepted for
        memcache_hybrid's signature; the tiers here are DRAM over disk."""
        return codes_of(len(keys), lambda: self._service().prefetch(keys))

    def pool_has_disk_tier(self) -> bool:
        """Whether, at the last heartbeat, a provider of the pool had a disk tier (without one no object
        is held on disk only, so ``prefetch`` has nothing to do)."""
        return self._svc is not None and self._svc.pool_disk_tiers > 0

    def evict(self, keys: list[str], src_media: Any = None, dst_media: Any = None, flags: int = 0) -> list[int]:
        """Keep objects on their provider's disk tier only: a code per key (0 done, -3007 not in the
        pool, -3101 not on disk yet: its provider was asked to write it, call again later)."""
        return codes_of(len(keys), lambda: self._service().evict(keys))

    def batch_get_key_info(self, keys: list[str], flag: int = 0) -> list[KeyInfo]:
        """Size, replica locations, media and GVAs of each key's object: committed ones, and those this
        store allocated with ``batch_alloc`` and has not finished. Absent keys (or a failed call): an
        empty ``KeyInfo`` (size 0). ``flag`` is accepted for memcache_hybrid's signature."""
        try:
            found = self._service().gva_info(keys)
        except (MemCacheError, TypeError, ValueError) as e:
            logger.debug("batch_get_key_info failed: %s", e)
            return [KeyInfo(0, [], []) for _ in keys]
        return [KeyInfo(0, [], []) if f is None else
                KeyInfo(f.size, [loc.segment_id for loc in f.locations] + ([f.disk] if f.disk else []),
                        ["DRAM"] * len(f.locations) + (["DISK"] if f.disk else []), gvas)
                for f, gvas in found]

    def get_key_info(self, key: str, flag: int = 0) -> KeyInfo:
        return self.batch_get_key_info([key], flag)[0]

    # ---- the GVA path (layer-wise): alloc -> copy ranges -> finish; lease -> copy ranges -> unlease ---

    def batch_alloc(self, keys: list[str], sizes: list[int], media: int = 1, leaseTtlMs: int = 0) -> list[int]:  # noqa: N803
        """Reserve objects to be written piece by piece through their GVAs (``batch_get_key_info``,
        ``batch_copy``); invisible to exist / get until ``batch_write_finish`` publishes them, reclaimed
        after the MetaService's ``pending_timeout_ms`` or when this store dies. A code per key; -3006 for
        a key that exists. ``media`` 0 (HBM) or 1 (DRAM): objects are placed in the pool's DRAM;
        ``leaseTtlMs`` is accepted (the pending deadline is the MetaService's)."""
        def run() -> list[int]:
            int_arg("media", media, 0, 1)
            int_arg("leaseTtlMs", leaseTtlMs, 0, 86_400_000)
            return [as_code(e) for e in self._service().gva_alloc(keys, sizes)]
        return codes_of(len(keys), run)

    def batch_copy(self, gva_ptrs: list[int], buffer_ptrs: list[int], sizes: list[int], direct: int,
                   flag: int = 0) -> int:
        """Copy ``sizes[i]`` bytes between the registered buffer at ``buffer_ptrs[i]`` and the object bytes
        at ``gva_ptrs[i]``: into an unfinished object of this store's (L2G / H2G), out of a committed one
        it holds a lease on (G2L / G2H), or as the object's state says (AUTO). 0, or the first error;
        nothing is copied when any range is refused."""
        if not (len(gva_ptrs) == len(buffer_ptrs) == len(sizes)):
            return errors.INVALID_PARAM
        return self.batch_copy_layers(gva_ptrs, [[x] for x in buffer_ptrs], [[n] for n in sizes], direct, flag)

    def batch_copy_layers(self, gva_ptrs: list[int], buffer_ptrs: list[list[int]], sizes: list[list[int]],
                          direct: int, flag: int = 0) -> int:
        """``batch_copy`` with a list of buffers per GVA, laid end to end from it."""
        def run() -> int:
            if not (len(gva_ptrs) == len(buffer_ptrs) == len(sizes)):
                raise InvalidParameter(f"gva_ptrs ({len(gva_ptrs)}), buffer_ptrs ({len(buffer_ptrs)}) and "
                                       f"sizes ({len(sizes)}) differ in length")
            if direct not in DIRECTIONS:
                raise InvalidParameter(f"direct: {direct!r} is not L2G (0), G2L (1), G2H (2), H2G (3) or AUTO (4)")
            pieces = [self._buffers.pieces(ps, ss) for ps, ss in zip(buffer_ptrs, sizes, strict=True)]
            self._service().gva_copy(gva_ptrs, pieces, DIRECTIONS[direct])
            return errors.SUCCESS
        return code_of(run)

    def batch_write_finish(self, keys: list[str], results: list[int]) -> list[int]:
        """Publish (result 0) or abort (non-zero) objects of ``batch_alloc``; a published object is
        readable from then on, with its checksum computed over all its bytes. A code per key."""
        return codes_of(len(keys), lambda: [as_code(e) for e in self._service().gva_finish(keys, results)])

    def batch_add_lease(self, keys: list[str], leaseTtlMs: int = 0) -> list[int]:  # noqa: N803
        """Lease committed objects to this store for ``leaseTtlMs`` (0: the pool's ``lease_ttl_ms``):
        copies out of them through GVAs need it, and eviction and removal wait for it. A code per key."""
        def run() -> list[int]:
            int_arg("leaseTtlMs", leaseTtlMs, 0, 86_400_000)
            return self._service().gva_lease(keys, leaseTtlMs)
        return codes_of(len(keys), run)

    def batch_remove_lease(self, keys: list[str]) -> int:
        """End this store's leases of ``batch_add_lease``: 0, or the first key's error (-3007 where it
        held none)."""
        return code_of(lambda: next((c for c in self._service().gva_unlease(keys) if c != 0), errors.SUCCESS))



def open_store(config: LocalConfig, device_id: int = 0, init_bm: bool = True) -> DistributedObjectStore:
    """``setup`` then ``init``, closing the half-made store if either fails: how the engine
    integrations join the pool. Raises the ``MemCacheError`` of the failing step's code (for
    example ``MetaServiceUnavailable``), naming the step and the MetaService."""
    store = DistributedObjectStore()
    steps = (("setup", lambda: store.setup(config)), ("init", lambda: store.init(device_id, init_bm)))
    for step, call in steps:
        rc = call()
        if rc != errors.SUCCESS:
            store.close()
            raise errors.error_from_code(rc, f"DistributedObjectStore.{step} failed with code {rc} "
                                             f"(MetaService {config.meta_service_url})")
    return store

