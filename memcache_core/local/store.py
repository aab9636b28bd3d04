"""``DistributedObjectStore``: the memcache_hybrid-compatible API, the one place exceptions become codes.

Argument order, defaults and return codes follow memcache_hybrid 1.3.0: 0 is success, batch calls
return one code per key, ``batch_get_into`` returns 0 per key on success, ``is_exist`` 1/0, ``get``
returns b"" when the key is absent. Pointer arguments must lie inside buffers given to
``register_buffer``; anything else is refused with -3000 before it is touched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .. import errors
from ..config import LocalConfig, ReplicateConfig, local_config_from_env
from ..errors import InvalidParameter, MemCacheError, NotInitialized
from .buffers import BufferRegistry, buffer_address
from .service import LocalService

logger = logging.getLogger(__name__)

# copy directions (accepted for compatibility; the path is chosen from the buffer and the segment)
L2G, G2L, G2H, H2G, AUTO = 0, 1, 2, 3, 4

T = TypeVar("T")


class KeyInfo:
    """What ``get_key_info`` returns, with memcache_hybrid's accessor methods."""

    def __init__(self, size: int, locations: list[int], media: list[str]) -> None:
        self._size, self._locs, self._media = size, locations, media

    def size(self) -> int:
        return self._size

    def loc_list(self) -> list[int]:
        return list(self._locs)

    def type_list(self) -> list[str]:
        return list(self._media)

    def gva_list(self) -> list[int]:
        return []

    def __repr__(self) -> str:
        return f"KeyInfo(size={self._size}, locations={self._locs})"


def _code(fn: Callable[[], int]) -> int:
    try:
        return fn()
    except MemCacheError as e:
        logger.debug("call failed: %s", e)
        return e.code
    except (TypeError, ValueError) as e:
        logger.debug("call refused: %s", e)
        return errors.INVALID_PARAM


def _codes(n: int, fn: Callable[[], list[int]]) -> list[int]:
    try:
        return fn()
    except MemCacheError as e:
        logger.debug("batch call failed: %s", e)
        return [e.code] * n
    except (TypeError, ValueError) as e:
        logger.debug("batch call refused: %s", e)
        return [errors.INVALID_PARAM] * n


def _replication(rc: Any) -> tuple[int, list[int]]:
    """(replicaNum, preferredLocalServiceIDs) of a put's replicateConfig: ours, memcache_hybrid's, or
    any object with those attributes; validated (-3000 naming the field)."""
    if rc is None:
        return 1, []
    cfg = ReplicateConfig(getattr(rc, "replicaNum", 1), list(getattr(rc, "preferredLocalServiceIDs", None) or []))
    cfg.validate()
    return cfg.replicaNum, list(cfg.preferredLocalServiceIDs)


def _as_code(e: MemCacheError | None) -> int:
    return errors.SUCCESS if e is None else e.code


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
        replicas, preferred = _replication(rc)
        ok = [i for i, e in enumerate(errs) if e is None]
        res = self._service().put([keys[i] for i in ok], [pieces[i] for i in ok], replicas, preferred)
        for i, e in zip(ok, res, strict=True):
            errs[i] = e
        return [_as_code(e) for e in errs]

    def batch_put_from_layers(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
                              direct: int = H2G, replicateConfig: Any = None) -> list[int]:  # noqa: N803
        def run() -> list[int]:
            pieces, errs = self._checked(keys, ptrs, sizes)
            return self._put(keys, pieces, errs, replicateConfig)
        return _codes(len(keys), run)

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
        return _code(run)

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
            return [_as_code(e) for e in errs]
        return _codes(len(keys), run)

    def get_into_layers(self, key: str, ptrs: list[int], sizes: list[int], direct: int = G2H) -> int:
        return self.batch_get_into_layers([key], [ptrs], [sizes], direct)[0]

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int], direct: int = G2H) -> list[int]:
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [errors.INVALID_PARAM] * len(keys)
        return self.batch_get_into_layers(keys, [[x] for x in ptrs], [[s] for s in sizes], direct)

    def get_into(self, key: str, ptr: int, size: int, direct: int = G2H) -> int:
        return self.batch_get_into_layers([key], [[ptr]], [[size]], direct)[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        try:
            svc = self._service()
            sizes = svc.lookup_sizes(keys)
        except (MemCacheError, TypeError, ValueError) as e:
            logger.debug("get_batch failed: %s", e)
            return [b""] * len(keys)
        bufs = [bytearray(f.size) if f is not None else bytearray() for f in sizes]
        anchors = [buffer_address(b) if b else None for b in bufs]
        want = [i for i, a in enumerate(anchors) if a is not None]
        res, _ = svc.get([keys[i] for i in want],
                         [[(anchors[i][0], anchors[i][1])] for i in want],  # type: ignore[index]
                         exact=False)
        out = [b""] * len(keys)
        for i, err in zip(want, res, strict=True):
            if err is None:
                out[i] = bytes(bufs[i])
        return out

    def get(self, key: str) -> bytes:
        return self.get_batch([key])[0]

    # ---- exist / remove / info ----------------------------------------------------------------------

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return _codes(len(keys), lambda: list(map(int, self._service().exist(keys))))

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def remove_batch(self, keys: list[str]) -> list[int]:
        return _codes(len(keys), lambda: self._service().remove(keys))

    def remove(self, key: str) -> int:
        return self.remove_batch([key])[0]

    def remove_by_prefix(self, prefix: str) -> int:
        """Remove every committed object whose key starts with ``prefix`` (a tenant's namespace) in one
        call. Returns how many were removed, or a negative code. Not in memcache_hybrid's API."""
        return _code(lambda: self._service().remove_prefix(prefix))

    def remove_all(self) -> int:
        def run() -> int:
            self._service().remove_all()
            return errors.SUCCESS
        return _code(run)

    # ---- tiers ----------------------------------------------------------------------------------------

    def prefetch(self, keys: list[str], src_media: Any = None, dst_media: Any = None) -> list[int]:
        """Bring objects a provider holds on its disk tier back into DRAM ahead of reading them: a code
        per key (0 in DRAM, -3007 not in the pool). The media arguments are accepted for
        memcache_hybrid's signature; the tiers here are DRAM over disk."""
        return _codes(len(keys), lambda: self._service().prefetch(keys))

    def pool_has_disk_tier(self) -> bool:
        """Whether, at the last heartbeat, a provider of the pool had a disk tier (without one no object
        is held on disk only, so ``prefetch`` has nothing to do)."""
        return self._svc is not None and self._svc.pool_disk_tiers > 0

    def evict(self, keys: list[str], src_media: Any = None, dst_media: Any = None) -> list[int]:
        """Keep objects on their provider's disk tier only: a code per key (0 done, -3007 not in the
        pool, -3101 not on disk yet: its provider was asked to write it, call again later)."""
        return _codes(len(keys), lambda: self._service().evict(keys))

    def batch_get_key_info(self, keys: list[str]) -> list[KeyInfo]:
        try:
            found = self._service().lookup_sizes(keys)
        except (MemCacheError, TypeError, ValueError):
            return [KeyInfo(0, [], []) for _ in keys]
        return [KeyInfo(0, [], []) if f is None else
                KeyInfo(f.size, [loc.segment_id for loc in f.locations] + ([f.disk] if f.disk else []),
                        ["DRAM"] * len(f.locations) + (["DISK"] if f.disk else []))
                for f in found]

    def get_key_info(self, key: str) -> KeyInfo:
        return self.batch_get_key_info([key])[0]


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

