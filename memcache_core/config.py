"""Configuration of the two process roles, with the field names of memcache_hybrid.

``MetaConfig`` configures the MetaService, ``LocalConfig`` a LocalService. Both are attribute bags
that integrations fill with ``setattr`` (as SGLang's stock backend does), so they are validated
again by ``validate()`` when a service starts; an invalid value raises ``ConfigError`` naming the key.

Precedence, written down once: values set explicitly on the object > values from the JSON file (the one
given, else the one named by ``MMC_META_CONFIG_PATH`` / ``MMC_LOCAL_CONFIG_PATH``) > environment
overrides ``MEMCACHE_<KEY>`` (e.g. ``MEMCACHE_HCOM_ADVERTISE_URL``; applied to configs read from a file
or from the environment) > defaults. Environment variables are read in this module only.

Each setting is declared by its annotation (``config_check.py``: a range with ``Meta(ge=, le=)``, a
choice with ``Literal``); ``validate()`` holds every field to its declaration, then runs the rules that
read several fields or parse a value (sizes, URLs), each a small function in ``LOCAL_RULES`` /
``META_RULES``. ``MetaConfig`` lives in ``config_meta.py``; the parsers of single values and a put's
``ReplicateConfig`` live in ``values.py``; all are re-exported here.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, get_args

from msgspec import Meta

from . import ascend_keys, tls
from .config_check import NUMBER, Bool, Str, check, env_kind, field_types
from .config_meta import MetaConfig as MetaConfig
from .config_meta import check_etcd_auth as check_etcd_auth
from .errors import ConfigError
from .values import FALSE_WORDS as FALSE_WORDS  # re-exported: integrations and tests import them from here
from .values import TRUE_WORDS as TRUE_WORDS
from .values import WILDCARD_HOSTS, check_cluster_id, check_log_level, parse_meta_target, parse_size
from .values import MetaTarget as MetaTarget
from .values import ReplicateConfig as ReplicateConfig  # (a put's placement: values.py)
from .values import parse_bool as parse_bool
from .values import parse_etcd_endpoints as parse_etcd_endpoints
from .values import parse_url as parse_url

logger = logging.getLogger(__name__)

META_CONFIG_ENV = "MMC_META_CONFIG_PATH"
LOCAL_CONFIG_ENV = "MMC_LOCAL_CONFIG_PATH"
ENV_PREFIX = "MEMCACHE_"            # MEMCACHE_<KEY in capitals>: a key the file leaves out (env_overrides)
STRICT_ENV = "MEMCACHE_CONFIG_STRICT"  # true: an unknown key in a config file is an error, not a warning

HostProtocol = Literal["host_shm", "host_tcp"]
AscendProtocol = Literal["host_rdma", "host_urma", "device_rdma", "device_sdma", "device_urma"]   # MemFabric
HOST_PROTOCOLS: tuple[str, ...] = get_args(HostProtocol)
ASCEND_PROTOCOLS: tuple[str, ...] = get_args(AscendProtocol)


@dataclasses.dataclass
class LocalConfig:
    """Settings of a LocalService (the store inside an inference process, or a standalone one)."""

    meta_service_url: str = "tcp://127.0.0.1:5000"
    """Where the MetaService listens: one URL, several (``tcp://a:5000,tcp://b:5000``, tried in turn),
    or ``etcd://h1:2379,h2:2379/<ha_cluster_id>`` to follow the HA leader."""
    config_store_url: str = "tcp://127.0.0.1:6000"
    """The MetaService's config store."""
    ha_etcd_ca_path: str = ""
    """With an ``etcd://`` meta_service_url: CA certificate (PEM) of etcd's server certificate: etcd is then spoken over https, verified."""
    ha_etcd_cert_path: str = ""
    """Client certificate (PEM) for an etcd run with ``--client-cert-auth``; needs ``ha_etcd_key_path``."""
    ha_etcd_key_path: str = ""
    """The private key of ``ha_etcd_cert_path`` (PEM)."""
    ha_etcd_user: str = ""
    """etcd user (etcd's auth enabled) to log in as; its password is in ``ha_etcd_password_path``."""
    ha_etcd_password_path: str = ""
    """File whose first line is the password of ``ha_etcd_user`` (mode 0600; refused if others can read it)."""
    log_level: str = "info"
    """debug, info, warning or error (applied to the memcache_core loggers)."""
    world_size: Annotated[int, Meta(ge=1, le=1024), NUMBER] = 256
    """Accepted for Ascend MemCache configs, in [1, 1024]; nothing here limits ranks by it."""
    protocol: Literal[HostProtocol, AscendProtocol] = "host_rdma"
    """host_shm (same-host peers copy through shared memory, others through TCP) or host_tcp (all TCP).
    host_rdma, host_urma, device_rdma, device_sdma and device_urma need MemFabric on Ascend."""
    hcom_url: str = "tcp://127.0.0.1:7000"
    """Address of this LocalService's data server (host_tcp); port 0 or a busy port picks a free one."""
    dram_size: int | str = "1GB"
    """Host memory this LocalService contributes to the pool."""
    hbm_size: int | str = "0"
    """Device memory contributed; must be 0 on host protocols."""
    max_dram_size: int | str = "0"
    """Accepted for compatibility."""
    max_hbm_size: int | str = "0"
    """Accepted for compatibility."""
    client_retry_milliseconds: Annotated[int, Meta(ge=0, le=3_600_000), NUMBER] = 0
    """Extra time idempotent calls (lookup, exist) keep retrying after a failure."""
    client_timeout_seconds: Annotated[float, Meta(ge=0.01, le=86400)] = 60
    """Longest wait for the MetaService; past it calls fail with -3017."""
    read_deadline_ms: Annotated[int, Meta(ge=0, le=3_600_000)] = 1000
    """A read from a peer's data server (TCP) that has another replica, or a disk record, to go to
    waits for the peer at most this long plus its bytes at 64 MiB/s (the progress deadline), then
    reads the next copy; the peer is read last for 10 s after. A read of the last copy waits up to
    ``client_timeout_seconds``. 0: every read waits that long (docs/design.md, "A frozen peer")."""
    read_thread_pool_size: Annotated[int, Meta(ge=1, le=1024), NUMBER] = 32
    """Threads that copy payload for reads (capped at the host's CPU count)."""
    write_thread_pool_size: Annotated[int, Meta(ge=1, le=1024), NUMBER] = 4
    """Threads that copy payload for writes (capped at the host's CPU count)."""
    aggregate_io: bool = True
    """Accepted for compatibility: pieces of one object are always moved in one request."""
    aggregate_num: int = 122
    """Accepted for compatibility."""
    ubs_io_enable: bool = False
    """SSD tier; not supported yet."""
    memory_pool_mode: str = "standard"
    """Accepted for compatibility."""
    tag: str = ""
    """Free-form label of this LocalService, shown in /get_all_segments."""
    heartbeat_interval_ms: Annotated[int, Meta(ge=10, le=600_000), NUMBER] = 1000
    """How often this LocalService tells the MetaService it is alive."""
    fence_wait_ms: Annotated[int, Meta(ge=0, le=600_000), NUMBER] = 3000
    """Before a re-join, wait this long for writes in flight into the segment to end; past it, re-join
    with the segment *held* (no new object placed in it until they have: docs/design.md, fence.py)."""
    rpc_spin_us: Annotated[int, Meta(ge=0, le=100_000)] = 0
    """A control-plane call polls for its reply this long before it sleeps (0: sleep at once)."""
    location_hints: Annotated[int, Meta(ge=0, le=1 << 24)] = 16384
    """How many keys' objects (size, generation, locations) this client remembers from its lookups, so
    that a get of such a key copies while its ``Lookup`` is on the way; the copy counts only where the
    reply names the same object at the same place (docs/design.md). 0: off."""
    host_id: str = ""
    """Identity of this host for choosing shared memory over TCP; empty = derived from the machine."""
    small_put_max_bytes: Annotated[int, Meta(ge=0, le=1 << 30)] = 64 << 10
    """A put of one replica whose payload is at most this many bytes goes into this LocalService's
    allocation arena (a range of its own segment the MetaService grants) and is committed in one round
    trip (docs/design.md, "Small puts"); larger ones, and all when 0, take the two-phase put."""
    checksum: Bool = True
    """Writers compute each object's payload checksum (XXH3-64) while they copy and commit it with the
    object; readers verify it. Off: objects carry no checksum and reads are not verified."""
    auth_enable: Bool = True
    """Authenticate to the MetaService and to peers' data servers with the pool secret, and require
    it from peers on this LocalService's data server; must match the MetaService's setting."""
    auth_secret_path: Str = ""
    """File holding the pool secret; empty = $MEMCACHE_SECRET_PATH, else the pool's default file
    (``pool_name``)."""
    pool_name: Str = ""
    """Names the pool: its default secret file is ~/.config/memcache/pool-<pool_name>.secret, so two
    pools of one user on one host do not share a secret. 1-64 letters, digits, '_', '.' or '-';
    empty: the user's one default file for unnamed pools (pool.secret). Set it alike on the
    MetaService and its members; auth_secret_path and $MEMCACHE_SECRET_PATH take precedence."""
    tls_enable: bool = False
    """Encrypt the control, config-store, data and admin planes with TLS (docs/security.md)."""
    tls_ca_path: str = ""
    """CA certificate (PEM) that signed every member's certificate."""
    tls_cert_path: str = ""
    """This process's certificate (PEM), signed by the pool's CA."""
    tls_key_path: str = ""
    """The private key of ``tls_cert_path`` (PEM)."""
    hcom_advertise_url: str = ""
    """Address peers use to reach this data server when ``hcom_url`` binds a wildcard (0.0.0.0)."""
    checksum_verify_ratio: Annotated[float, Meta(ge=0, le=1)] = 1.0
    """Fraction of reads whose bytes are verified against the checksum, in [0, 1]; a mismatch is a
    miss, counted and logged, and the object is dropped from the pool."""
    drain_timeout_ms: Annotated[int, Meta(ge=0, le=86_400_000)] = 0
    """On close (``store.close()``, SIGTERM of ``memcache local-service``) move this LocalService's
    objects to other segments with room for at most this long before leaving; 0: leave at once (its
    objects leave the pool with it)."""
    metrics_port: Annotated[int, Meta(ge=0, le=65535), NUMBER] = 0
    """Serve this LocalService's Prometheus metrics (transfer bytes and latency per path) on this
    port; 0 = off. Needs the admin token when ``auth_enable`` (docs/operations.md). Inside an engine
    it is a base: each rank serves on ``metrics_port + rank`` (``for_rank``). A port that cannot be
    bound is a warning inside an engine, never a failed start (``memcache local-service`` refuses)."""
    metrics_host: Str = "127.0.0.1"
    """Address the metrics port binds (``metrics_port``)."""
    transfer_engine: Literal["builtin", "nixl"] = "builtin"
    """How bytes cross hosts: ``builtin`` (the TCP data server) or ``nixl`` (one-sided READ/WRITE through
    NIXL over UCX, for pieces in registered buffers; needs the ``nixl`` package, docs/nixl.md)."""
    disk_path: Str = ""
    """Directory of this provider's disk tier (records of objects evicted from DRAM, found again after a
    restart); empty = no disk tier. One provider per directory (a lock file refuses a second)."""
    disk_size: int | str = "0"
    """Bytes the disk tier may hold (required with ``disk_path``); when full, its least recently used
    records are dropped for good."""
    disk_write_policy: Literal["on_evict", "write_through"] = "on_evict"
    """on_evict: objects are copied to disk in the background as their segment nears its eviction mark;
    write_through: every committed object is copied to disk as soon as it is committed."""
    disk_write_limit: int | str = "0"
    """Most bytes per second the background disk writer writes (0 = no limit)."""
    shm_copy_threads: Annotated[int, Meta(ge=0, le=64)] = 0
    """Threads one batch's shared-memory copies are split over, piece by piece (a large piece is cut
    in parts); 0 = automatic: half the CPUs, at most 4 (2 CPUs: 2 with the native loop, else 1). Batches
    under 1 MiB are copied on the calling thread."""
    shm_copy_loop: Literal["auto", "native", "python"] = "auto"
    """The loop that runs shared-memory copies and their checksums: native (the C loop built at install,
    one call per batch part, outside the GIL), python (one ``memmove`` and hash call per piece), or
    auto = native where it was built, else python."""
    data_server_loop: Literal["auto", "native", "python"] = "auto"
    """The loop that serves peers' requests on this provider's data server (``host_tcp``): native (a C
    loop built at install answers plain-TCP reads outside the GIL; writes, disk requests and TLS
    connections stay in Python), python, or auto = native where it was built, else python."""
    segment_prefault: Literal["auto", "on", "off"] = "auto"
    """Fault the segment's pages in at start, in the background (puts never wait for it): on, off, or
    auto = on for ``memcache local-service`` providers, off for segments inside an engine process."""
    segment_hugepages: Bool = True
    """Ask for transparent huge pages on the segment (MADV_HUGEPAGE) where the host's
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows them; otherwise one log line."""

    def for_rank(self, rank: int) -> LocalConfig:
        """This config for an engine's ``rank`` on this host: ``metrics_port`` is a base, and each
        rank serves on its own ``metrics_port + rank`` (one port shared by tensor-parallel ranks
        would leave all but the first without metrics)."""
        if self.metrics_port and rank:
            port = self.metrics_port + rank
            if port > 65535:
                raise ConfigError(f"metrics_port: {self.metrics_port} + rank {rank} is past 65535; "
                                  "choose a lower base port")
            return dataclasses.replace(self, metrics_port=port)
        return self

    def __post_init__(self) -> None:
        self.validate()

    @property
    def dram_bytes(self) -> int:
        return parse_size(self.dram_size, "dram_size")

    def validate(self) -> None:
        """Every field against its declaration, then the rules that read several (``LOCAL_RULES``)."""
        check(self)
        for rule in LOCAL_RULES:
            rule(self)


def _urls(cfg: LocalConfig) -> None:
    if cfg.pool_name:
        check_cluster_id(cfg.pool_name, "pool_name")
    if parse_meta_target(cfg.meta_service_url, "meta_service_url").etcd:
        check_etcd_auth(cfg, cfg.meta_service_url)
    parse_url(cfg.config_store_url, "config_store_url", ("tcp",))
    parse_url(cfg.hcom_url, "hcom_url", ("tcp",))


def _memory(cfg: LocalConfig) -> None:
    """Sizes parse; device memory only on an Ascend protocol."""
    for key in ("dram_size", "hbm_size", "max_dram_size", "max_hbm_size"):
        parse_size(getattr(cfg, key), key)
    if cfg.protocol in HOST_PROTOCOLS and parse_size(cfg.hbm_size, "hbm_size") != 0:
        raise ConfigError(f"hbm_size: must be 0 with protocol {cfg.protocol}")


def _metrics(cfg: LocalConfig) -> None:
    if cfg.metrics_port and not cfg.metrics_host:
        raise ConfigError("metrics_host: must name an address to bind (127.0.0.1 by default)")


def _advertised(cfg: LocalConfig) -> None:
    """Peers must be able to reach the data server: a wildcard bind needs an address to advertise."""
    if cfg.hcom_advertise_url:
        host, _ = parse_url(cfg.hcom_advertise_url, "hcom_advertise_url", ("tcp",))
        if host in WILDCARD_HOSTS:
            raise ConfigError("hcom_advertise_url: must name an address peers can reach, not a wildcard")
    elif parse_url(cfg.hcom_url, "hcom_url", ("tcp",))[0] in WILDCARD_HOSTS:
        raise ConfigError(f"hcom_url: {cfg.hcom_url} binds every interface; set hcom_advertise_url to the "
                          f"address peers should use")


def _transfer_engine(cfg: LocalConfig) -> None:
    if cfg.transfer_engine == "nixl" and cfg.tls_enable:
        raise ConfigError("transfer_engine: 'nixl' moves payload outside TLS (UCX does not encrypt); "
                          "with tls_enable use 'builtin'")
    if cfg.transfer_engine == "nixl" and importlib.util.find_spec("nixl") is None:
        raise ConfigError("transfer_engine: 'nixl' needs the nixl package "
                          "(pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1); it is not installed")


def _disk(cfg: LocalConfig) -> None:
    size = parse_size(cfg.disk_size, "disk_size")
    parse_size(cfg.disk_write_limit, "disk_write_limit")
    if cfg.disk_path and size < (1 << 20):
        raise ConfigError(f"disk_size: must be at least 1MB with disk_path set, got {cfg.disk_size!r}")


def _no_ssd_tier(cfg: LocalConfig) -> None:
    if cfg.ubs_io_enable:
        raise ConfigError("ubs_io_enable: the SSD tier is not supported yet; set it to false")


LOCAL_RULES: tuple[Callable[[LocalConfig], None], ...] = (
    _urls, lambda cfg: check_log_level(cfg.log_level), _memory, _metrics, _transfer_engine, tls.check,
    _advertised, _disk, _no_ssd_tier)


C = TypeVar("C", MetaConfig, LocalConfig)


def apply_dict(cfg: C, values: dict[str, Any], source: str = "config", strict: bool | None = None) -> C:
    """Set known fields from ``values``; then validate. An unknown key is named with the nearest known
    one: a warning, or with ``strict`` (default: ``$MEMCACHE_CONFIG_STRICT``) a ConfigError (``known``).

    All or nothing: the values are validated on a copy, and ``cfg`` changes only if they pass."""
    trial = dataclasses.replace(cfg, **known(cfg, values, source, strict))
    trial.validate()
    for f in dataclasses.fields(cfg):
        setattr(cfg, f.name, getattr(trial, f.name))
    return cfg


def known(cfg: C, values: dict[str, Any], source: str = "config", strict: bool | None = None) -> dict[str, Any]:
    """The keys of ``values`` that are fields of ``cfg``. A key of the other role's config is the other
    role's (one pool file serves the MetaService and its members), skipped; a key neither knows is
    warned about, or refused in strict mode (``apply_dict``)."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cfg)}
    other = {f.name for f in dataclasses.fields(LocalConfig if isinstance(cfg, MetaConfig) else MetaConfig)}
    setting = lambda name: values.get(name, getattr(cfg, name, None))  # noqa: E731 - the value it will have
    unknown = sorted(k for k, v in values.items()
                     if k not in names and k not in other and not ascend_keys.check(k, v, setting))
    if unknown:
        what = "; ".join(_unknown_key(k, names | other) for k in unknown)
        if strict if strict is not None else strict_from_env():
            raise ConfigError(f"{source}: unknown {type(cfg).__name__} keys: {what} (strict mode: "
                              f"{STRICT_ENV} is set; fix or remove them)")
        logger.warning("%s: ignoring unknown %s keys: %s", source, type(cfg).__name__, what)
    return {k: v for k, v in values.items() if k in names}


def _unknown_key(key: Any, names: set[str]) -> str:
    near = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.6)
    return f"{key!r} (did you mean {near[0]!r}?)" if near else f"{key!r} (no such key; docs/configuration.md lists them)"


def strict_from_env() -> bool:
    """``$MEMCACHE_CONFIG_STRICT``: refuse unknown config keys (default false)."""
    return parse_bool(STRICT_ENV, os.environ.get(STRICT_ENV, "false"))


def env_overrides(cls: type[C]) -> dict[str, Any]:
    """The keys of ``cls`` set in the environment as ``MEMCACHE_<KEY>`` (``MEMCACHE_DRAM_SIZE=32GB``),
    converted to the key's type; a value that does not convert is a ConfigError naming the variable."""
    out: dict[str, Any] = {}
    for key, hint in field_types(cls).items():
        var = ENV_PREFIX + key.upper()
        raw = os.environ.get(var)
        if raw is None:
            continue
        kind = env_kind(hint)
        if kind == "bool":
            out[key] = parse_bool(var, raw)
        elif kind in ("int", "float"):
            try:
                out[key] = int(raw, 0) if kind == "int" else float(raw)
            except ValueError:
                raise ConfigError(f"{var}: expected {'an integer' if kind == 'int' else 'a number'} "
                                  f"for {key}, got {raw!r}") from None
        elif kind == "str":   # strings, choices, and sizes (int | str): "32GB" or "1073741824"
            out[key] = raw
        else:
            raise ConfigError(f"{var}: {key} cannot be set from the environment; set it in the config file")
    return out


def file_values(cls: type[C], path: str, strict: bool | None = None) -> dict[str, Any]:
    """The keys of ``cls`` set by the JSON file ``path`` (a pool file may hold both roles' keys:
    ``known``) over the environment's overrides; a missing file or bad JSON raises ConfigError naming
    ``config_path``. Engines lay the keys they are given inline over these."""
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except OSError as e:
        raise ConfigError(f"config_path: cannot read {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"config_path: {path} is not valid JSON: {e}") from e
    if not isinstance(values, dict):
        raise ConfigError(f"config_path: {path}: expected a JSON object, got {type(values).__name__}")
    return known(cls(), {**env_overrides(cls), **values}, path, strict)


def load_file(cls: type[C], path: str, strict: bool | None = None) -> C:
    """Build a config from a JSON file over the environment's overrides (``file_values``), validated
    as one: a pair of keys checked together (hcom_url, hcom_advertise_url) may come half from each."""
    return apply_dict(cls(), file_values(cls, path, strict), source=path, strict=strict)


def meta_config_from_env() -> MetaConfig:
    path = os.environ.get(META_CONFIG_ENV)
    return load_file(MetaConfig, path) if path else apply_dict(MetaConfig(), env_overrides(MetaConfig), "environment")


def local_config_from_env() -> LocalConfig:
    path = os.environ.get(LOCAL_CONFIG_ENV)
    return load_file(LocalConfig, path) if path else apply_dict(LocalConfig(), env_overrides(LocalConfig), "environment")
