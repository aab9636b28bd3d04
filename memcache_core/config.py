"""Configuration of the two process roles, with the field names of memcache_hybrid.

``MetaConfig`` configures the MetaService, ``LocalConfig`` a LocalService. Both are attribute bags
that integrations fill with ``setattr`` (as SGLang's stock backend does), so they are validated
again by ``validate()`` when a service starts; an invalid value raises ``ConfigError`` naming the key.

Precedence, written down once: values set explicitly on the object > values from the JSON file (the one
given, else the one named by ``MMC_META_CONFIG_PATH`` / ``MMC_LOCAL_CONFIG_PATH``) > environment
overrides ``MEMCACHE_<KEY>`` (e.g. ``MEMCACHE_HCOM_ADVERTISE_URL``; applied to configs read from a file
or from the environment) > defaults. Environment variables are read in this module only. The parsers
of single values live in ``values.py`` and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import logging
import os
from typing import Any, TypeVar

from . import ascend_keys, tls
from .errors import ConfigError
from .values import FALSE_WORDS as FALSE_WORDS  # re-exported: integrations and tests import them from here
from .values import TRUE_WORDS as TRUE_WORDS
from .values import (
    WILDCARD_HOSTS,
    check_bool,
    check_cluster_id,
    check_int,
    check_log_level,
    check_range,
    check_str,
    parse_etcd_endpoints,
    parse_meta_target,
    parse_size,
    parse_url,
)
from .values import MetaTarget as MetaTarget
from .values import parse_bool as parse_bool

logger = logging.getLogger(__name__)

META_CONFIG_ENV = "MMC_META_CONFIG_PATH"
LOCAL_CONFIG_ENV = "MMC_LOCAL_CONFIG_PATH"
ENV_PREFIX = "MEMCACHE_"            # MEMCACHE_<KEY in capitals>: a key the file leaves out (env_overrides)
STRICT_ENV = "MEMCACHE_CONFIG_STRICT"  # true: an unknown key in a config file is an error, not a warning

HOST_PROTOCOLS = ("host_shm", "host_tcp")
PLACEMENT_POLICIES = ("local_first", "spread", "random")
ASCEND_PROTOCOLS = ("host_rdma", "host_urma", "device_rdma", "device_sdma", "device_urma")
DISK_WRITE_POLICIES = ("on_evict", "write_through")


@dataclasses.dataclass
class MetaConfig:
    """Settings of the MetaService process."""

    meta_service_url: str = "tcp://127.0.0.1:5000"
    """Control-plane address LocalServices talk to (length-prefixed msgspec frames over TCP)."""
    config_store_url: str = "tcp://127.0.0.1:6000"
    """Small key-value store for rendezvous data (transfer-engine addresses)."""
    metrics_url: str = "http://127.0.0.1:8000"
    """HTTP admin server: /health, /metrics (Prometheus), key and segment queries."""
    ha_enable: bool = False
    """Several MetaServices, one leader elected through etcd; the others stand by (docs/operations.md)."""
    ha_etcd_endpoints: str = ""
    """etcd client endpoints with ``ha_enable``: ``http://h1:2379,http://h2:2379`` (tried in turn)."""
    ha_cluster_id: str = "default"
    """Names this pool in etcd: the leader key is ``/memcache/<ha_cluster_id>/leader``."""
    ha_lease_ttl_ms: int = 5000
    """TTL of the leader's etcd lease (whole seconds, at least 2 s): a standby takes over this long after
    the leader stops renewing; the leader stops serving once 3/4 of it passed without a renewal."""
    ha_etcd_ca_path: str = ""
    """CA certificate (PEM) of etcd's server certificate: etcd is then spoken over https, verified."""
    ha_etcd_cert_path: str = ""
    """Client certificate (PEM) for an etcd run with ``--client-cert-auth``; needs ``ha_etcd_key_path``."""
    ha_etcd_key_path: str = ""
    """The private key of ``ha_etcd_cert_path`` (PEM)."""
    ha_etcd_user: str = ""
    """etcd user (etcd's auth enabled) to log in as; its password is in ``ha_etcd_password_path``."""
    ha_etcd_password_path: str = ""
    """File whose first line is the password of ``ha_etcd_user`` (mode 0600; refused if others can read it)."""
    log_level: str = "info"
    """debug, info, warning or error."""
    log_path: str = ""
    """Directory for the log file; empty logs to stderr."""
    log_output_target: str = ""
    """Where the MetaService logs: ``file`` (under ``log_path``, which it then needs), ``stdout`` or
    ``stderr``; empty: ``file`` when ``log_path`` is set, else ``stderr``."""
    log_rotation_file_size: int = 20
    """MB per log file (under ``log_path``) before it is rotated, in [1, 10240]."""
    log_rotation_file_count: int = 50
    """Rotated log files kept beside the current one, in [1, 1000]."""
    evict_threshold_high: float = 90
    """Segment usage (percent) above which LRU eviction starts."""
    evict_threshold_low: float = 80
    """Segment usage (percent) eviction brings a segment down to."""
    evict_check_interval_seconds: float = 5
    """How often every segment is checked against the high-water mark (puts check at once)."""
    lease_ttl_ms: int = 10000
    """Read lease granted by lookup: the object is neither evicted nor its space reused meanwhile."""
    lru_shard_count: int = 16
    """Accepted for compatibility; the LRU here is one list per segment."""
    defrag_evict_threshold: float = 70
    """Accepted for compatibility."""
    kv_events_enable: bool = False
    """Publish "blocks stored" / "blocks removed" events on ``kv_events_endpoint`` (ZeroMQ PUB, vLLM's
    KV-event format; needs the ``events`` extra, pyzmq)."""
    kv_events_endpoint: str = "tcp://127.0.0.1:5557"
    """Where the KV-event PUB socket binds (tcp://HOST:PORT)."""
    kv_events_model_name: str = ""
    """Model name put at the head of every KV-event topic."""
    kv_events_block_size: int = 16
    """Tokens per block, carried in every BlockStored event."""
    kv_events_queue_size: int = 100000
    """Events waiting to be sent; past it new events are dropped and counted, never waited for."""
    kv_events_replay_endpoint: str = ""
    """ROUTER socket (tcp://HOST:PORT) that sends a late or lagging subscriber the batches it missed,
    as vLLM's publisher does; empty = no replay."""
    kv_events_buffer_steps: int = 10000
    """Batches kept for replay."""
    zmq_enable_curve: bool = False
    """Encrypt and authenticate the KV-event sockets with ZeroMQ CURVE: only subscribers whose public
    certificates are in ``zmq_curve_client_keys_dir`` get in."""
    zmq_curve_server_key_file: str = ""
    """The publisher's secret CURVE certificate (``zmq.auth.create_certificates`` writes one)."""
    zmq_curve_client_keys_dir: str = ""
    """Folder of the public CURVE certificates of the subscribers allowed in."""
    heartbeat_timeout_ms: int = 10000
    """A LocalService silent this long is declared dead and its objects leave the table."""
    pending_timeout_ms: int = 120000
    """A put allocated but not committed this long is aborted and its space reclaimed."""
    member_max_pending_objects: int = 1 << 20
    """Objects one member may hold allocated and not committed; an Alloc beyond it is refused (-3112)."""
    member_max_pending_bytes: int = 0
    """Payload bytes (times replicas) one member may hold allocated and not committed; 0: no bound but
    the pool's size. An Alloc beyond it is refused (-3112)."""
    auth_enable: bool = True
    """Every connection proves it holds the pool secret (HMAC challenge-response) before anything
    else; false only for a single trusted host (docs/security.md)."""
    auth_secret_path: str = ""
    """File holding the pool secret; empty = $MEMCACHE_SECRET_PATH or ~/.config/memcache/pool.secret
    (a MetaService creates that default file, 0600, when it is missing)."""
    config_store_max_value_bytes: int = 1 << 20
    """Largest value the config store accepts."""
    config_store_max_total_bytes: int = 64 << 20
    """Most bytes (keys and values) the config store holds."""
    tls_enable: bool = False
    """Encrypt the control, config-store, data and admin planes with TLS (docs/security.md)."""
    tls_ca_path: str = ""
    """CA certificate (PEM) that signed every member's certificate."""
    tls_cert_path: str = ""
    """This process's certificate (PEM), signed by the pool's CA."""
    tls_key_path: str = ""
    """The private key of ``tls_cert_path`` (PEM)."""
    max_connections: int = 4096
    """Connections the control plane keeps open at once; more are refused."""
    idle_timeout_seconds: float = 600
    """A control-plane connection silent this long is closed (a client reconnects on its next call)."""
    poll_spin_us: int = 200
    """After serving requests the control plane polls for more this long before it sleeps: a request
    arriving meanwhile does not pay the wake-up of an idle core (0: sleep at once)."""
    placement_policy: str = "local_first"
    """Where new objects go: local_first (the writer's own segment, then as spread; a writer without a
    segment gets spread), spread (most free ratio first, the better of two random picks), or random.
    A put's preferredLocalServiceIDs come first under every policy (docs/design.md, Allocation)."""
    drain_timeout_ms: int = 60000
    """Longest a drain started with ``POST /drain/<segment_id>`` may take (a drain a leaving
    LocalService starts is bounded by its own ``drain_timeout_ms``)."""
    repair_enable: bool = True
    """Re-replication: an object with fewer replicas than its put asked for (a holder died, a copy was
    corrupt, the put found too few segments with room) is copied again by a surviving holder to a
    segment with room below the high-water mark, hosts without a replica first (docs/design.md)."""
    stats_sample_interval_seconds: float = 5
    """How often the counters are sampled for the status page's chart (the last 120 samples are kept)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        parse_url(self.meta_service_url, "meta_service_url", ("tcp",))
        parse_url(self.config_store_url, "config_store_url", ("tcp",))
        parse_url(self.metrics_url, "metrics_url", ("http", "https"))
        check_bool("ha_enable", self.ha_enable)
        if self.placement_policy not in PLACEMENT_POLICIES:
            raise ConfigError(f"placement_policy: expected one of {', '.join(PLACEMENT_POLICIES)}, "
                              f"got {self.placement_policy!r}")
        if self.ha_enable:
            parse_etcd_endpoints(self.ha_etcd_endpoints, "ha_etcd_endpoints")
            check_etcd_auth(self, self.ha_etcd_endpoints)
            check_cluster_id(self.ha_cluster_id, "ha_cluster_id")
            check_range("ha_lease_ttl_ms", self.ha_lease_ttl_ms, 2000, 600_000)
            if self.ha_lease_ttl_ms % 1000:
                raise ConfigError(f"ha_lease_ttl_ms: etcd leases count whole seconds; got {self.ha_lease_ttl_ms}")
        check_log_level(self.log_level)
        if self.log_output_target not in ("", "file", "stdout", "stderr"):
            raise ConfigError(f"log_output_target: expected file, stdout or stderr, got {self.log_output_target!r}")
        if self.log_output_target == "file" and not self.log_path:
            raise ConfigError("log_output_target: 'file' needs log_path (the directory of the log file)")
        check_range("log_rotation_file_size", self.log_rotation_file_size, 1, 10240)
        check_range("log_rotation_file_count", self.log_rotation_file_count, 1, 1000)
        check_range("evict_threshold_high", self.evict_threshold_high, 1, 100)
        check_range("evict_threshold_low", self.evict_threshold_low, 0, 100)
        if self.evict_threshold_low >= self.evict_threshold_high:
            raise ConfigError(
                f"evict_threshold_low: must be below evict_threshold_high "
                f"({self.evict_threshold_low} >= {self.evict_threshold_high})")
        check_range("evict_check_interval_seconds", self.evict_check_interval_seconds, 0.01, 3600)
        check_range("lease_ttl_ms", self.lease_ttl_ms, 10, 3_600_000)
        check_range("heartbeat_timeout_ms", self.heartbeat_timeout_ms, 100, 3_600_000)
        check_range("pending_timeout_ms", self.pending_timeout_ms, 100, 86_400_000)
        check_range("member_max_pending_objects", self.member_max_pending_objects, 1, 1 << 40)
        check_range("member_max_pending_bytes", self.member_max_pending_bytes, 0, 1 << 60)
        check_bool("auth_enable", self.auth_enable)
        check_str("auth_secret_path", self.auth_secret_path)
        check_range("config_store_max_value_bytes", self.config_store_max_value_bytes, 1, 1 << 30)
        check_range("config_store_max_total_bytes", self.config_store_max_total_bytes, 1, 1 << 34)
        check_range("max_connections", self.max_connections, 16, 1 << 20)
        tls.check(self)
        check_range("idle_timeout_seconds", self.idle_timeout_seconds, 1, 86400 * 7)
        check_int("poll_spin_us", self.poll_spin_us, 0, 100_000)
        check_int("drain_timeout_ms", self.drain_timeout_ms, 100, 86_400_000)
        check_bool("repair_enable", self.repair_enable)
        check_range("stats_sample_interval_seconds", self.stats_sample_interval_seconds, 0.1, 3600)
        self._check_kv_events()

    def _check_kv_events(self) -> None:
        check_bool("kv_events_enable", self.kv_events_enable)
        check_str("kv_events_model_name", self.kv_events_model_name)
        check_range("kv_events_block_size", self.kv_events_block_size, 1, 1 << 20)
        check_range("kv_events_queue_size", self.kv_events_queue_size, 1, 10_000_000)
        check_range("kv_events_buffer_steps", self.kv_events_buffer_steps, 1, 10_000_000)
        check_str("kv_events_replay_endpoint", self.kv_events_replay_endpoint)
        check_bool("zmq_enable_curve", self.zmq_enable_curve)
        check_str("zmq_curve_server_key_file", self.zmq_curve_server_key_file)
        check_str("zmq_curve_client_keys_dir", self.zmq_curve_client_keys_dir)
        if not self.kv_events_enable:
            return
        parse_url(self.kv_events_endpoint, "kv_events_endpoint", ("tcp",))
        if self.kv_events_replay_endpoint:
            parse_url(self.kv_events_replay_endpoint, "kv_events_replay_endpoint", ("tcp",))
            if self.kv_events_replay_endpoint == self.kv_events_endpoint:
                raise ConfigError("kv_events_replay_endpoint: must differ from kv_events_endpoint "
                                  f"({self.kv_events_endpoint}); give the replay socket its own port")
        if self.zmq_enable_curve:
            for key in ("zmq_curve_server_key_file", "zmq_curve_client_keys_dir"):
                if not getattr(self, key):
                    raise ConfigError(f"{key}: needed with zmq_enable_curve (docs/operations.md#kv-events)")
            if not os.path.isdir(self.zmq_curve_client_keys_dir):
                raise ConfigError(f"zmq_curve_client_keys_dir: {self.zmq_curve_client_keys_dir!r} is not a "
                                  "folder; put the subscribers' public certificates (*.key) in one")
        try:
            import zmq  # noqa: F401
        except ImportError as e:
            raise ConfigError("kv_events_enable: needs pyzmq (the events extra: pip install pyzmq, or the wheel with "
                              "[events]; docs/operations.md, Install)") from e


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
    world_size: int = 256
    """Accepted for Ascend MemCache configs, in [1, 1024]; nothing here limits ranks by it."""
    protocol: str = "host_rdma"
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
    client_retry_milliseconds: int = 0
    """Extra time idempotent calls (lookup, exist) keep retrying after a failure."""
    client_timeout_seconds: float = 60
    """Longest wait for the MetaService; past it calls fail with -3017."""
    read_deadline_ms: int = 1000
    """A read from a peer's data server (TCP) that has another replica, or a disk record, to go to
    waits for the peer at most this long plus its bytes at 64 MiB/s (the progress deadline), then
    reads the next copy; the peer is read last for 10 s after. A read of the last copy waits up to
    ``client_timeout_seconds``. 0: every read waits that long (docs/design.md, "A frozen peer")."""
    read_thread_pool_size: int = 32
    """Threads that copy payload for reads (capped at the host's CPU count)."""
    write_thread_pool_size: int = 4
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
    heartbeat_interval_ms: int = 1000
    """How often this LocalService tells the MetaService it is alive."""
    rpc_spin_us: int = 50
    """A control-plane call polls for its reply this long before it sleeps (0: sleep at once)."""
    location_hints: int = 16384
    """How many keys' objects (size, generation, locations) this client remembers from its lookups, so
    that a get of such a key copies while its ``Lookup`` is on the way; the copy counts only where the
    reply names the same object at the same place (docs/design.md). 0: off."""
    host_id: str = ""
    """Identity of this host for choosing shared memory over TCP; empty = derived from the machine."""
    checksum: bool = True
    """Writers compute each object's payload checksum (XXH3-64) while they copy and commit it with the
    object; readers verify it. Off: objects carry no checksum and reads are not verified."""
    auth_enable: bool = True
    """Authenticate to the MetaService and to peers' data servers with the pool secret, and require
    it from peers on this LocalService's data server; must match the MetaService's setting."""
    auth_secret_path: str = ""
    """File holding the pool secret; empty = $MEMCACHE_SECRET_PATH or ~/.config/memcache/pool.secret."""
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
    checksum_verify_ratio: float = 1.0
    """Fraction of reads whose bytes are verified against the checksum, in [0, 1]; a mismatch is a
    miss, counted and logged, and the object is dropped from the pool."""
    drain_timeout_ms: int = 0
    """On close (``store.close()``, SIGTERM of ``memcache local-service``) move this LocalService's
    objects to other segments with room for at most this long before leaving; 0: leave at once (its
    objects leave the pool with it)."""
    metrics_port: int = 0
    """Serve this LocalService's Prometheus metrics (transfer bytes and latency per path) on this
    port; 0 = off. Needs the admin token when ``auth_enable`` (docs/operations.md). Inside an engine
    it is a base: each rank serves on ``metrics_port + rank`` (``for_rank``). A port that cannot be
    bound is a warning inside an engine, never a failed start (``memcache local-service`` refuses)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics port binds (``metrics_port``)."""
    transfer_engine: str = "builtin"
    """How bytes cross hosts: ``builtin`` (the TCP data server) or ``nixl`` (one-sided READ/WRITE through
    NIXL over UCX, for pieces in registered buffers; needs the ``nixl`` package, docs/nixl.md)."""
    disk_path: str = ""
    """Directory of this provider's disk tier (records of objects evicted from DRAM, found again after a
    restart); empty = no disk tier. One provider per directory (a lock file refuses a second)."""
    disk_size: int | str = "0"
    """Bytes the disk tier may hold (required with ``disk_path``); when full, its least recently used
    records are dropped for good."""
    disk_write_policy: str = "on_evict"
    """on_evict: objects are copied to disk in the background as their segment nears its eviction mark;
    write_through: every committed object is copied to disk as soon as it is committed."""
    disk_write_limit: int | str = "0"
    """Most bytes per second the background disk writer writes (0 = no limit)."""
    shm_copy_threads: int = 0
    """Threads one batch's shared-memory copies are split over, piece by piece (a large piece is cut
    in parts); 0 = automatic: half the CPUs, at most 4 (2 CPUs: 2 with the native loop, else 1). Batches
    under 1 MiB are copied on the calling thread."""
    shm_copy_loop: str = "auto"
    """The loop that runs shared-memory copies and their checksums: native (the C loop built at install,
    one call per batch part, outside the GIL), python (one ``memmove`` and hash call per piece), or
    auto = native where it was built, else python."""
    segment_prefault: str = "auto"
    """Fault the segment's pages in at start, in the background (puts never wait for it): on, off, or
    auto = on for ``memcache local-service`` providers, off for segments inside an engine process."""
    segment_hugepages: bool = True
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
        if parse_meta_target(self.meta_service_url, "meta_service_url").etcd:
            check_etcd_auth(self, self.meta_service_url)
        parse_url(self.config_store_url, "config_store_url", ("tcp",))
        parse_url(self.hcom_url, "hcom_url", ("tcp",))
        check_log_level(self.log_level)
        check_range("world_size", self.world_size, 1, 1024)
        if self.protocol not in HOST_PROTOCOLS + ASCEND_PROTOCOLS:
            raise ConfigError(
                f"protocol: unknown protocol {self.protocol!r}; expected one of "
                f"{', '.join(HOST_PROTOCOLS + ASCEND_PROTOCOLS)}")
        parse_size(self.dram_size, "dram_size")
        for key in ("hbm_size", "max_dram_size", "max_hbm_size"):
            parse_size(getattr(self, key), key)
        if self.protocol in HOST_PROTOCOLS and parse_size(self.hbm_size, "hbm_size") != 0:
            raise ConfigError(f"hbm_size: must be 0 with protocol {self.protocol}")
        check_range("client_timeout_seconds", self.client_timeout_seconds, 0.01, 86400)
        check_range("client_retry_milliseconds", self.client_retry_milliseconds, 0, 3_600_000)
        check_int("read_deadline_ms", self.read_deadline_ms, 0, 3_600_000)
        check_range("read_thread_pool_size", self.read_thread_pool_size, 1, 1024)
        check_range("write_thread_pool_size", self.write_thread_pool_size, 1, 1024)
        check_range("heartbeat_interval_ms", self.heartbeat_interval_ms, 10, 600_000)
        check_int("rpc_spin_us", self.rpc_spin_us, 0, 100_000)
        check_int("location_hints", self.location_hints, 0, 1 << 24)
        check_range("metrics_port", self.metrics_port, 0, 65535)
        check_str("metrics_host", self.metrics_host)
        if self.metrics_port and not self.metrics_host:
            raise ConfigError("metrics_host: must name an address to bind (127.0.0.1 by default)")
        check_bool("checksum", self.checksum)
        check_bool("auth_enable", self.auth_enable)
        check_str("auth_secret_path", self.auth_secret_path)
        _check_transfer_engine(self.transfer_engine, self.tls_enable)
        tls.check(self)
        if self.hcom_advertise_url:
            host, _ = parse_url(self.hcom_advertise_url, "hcom_advertise_url", ("tcp",))
            if host in WILDCARD_HOSTS:
                raise ConfigError("hcom_advertise_url: must name an address peers can reach, not a wildcard")
        elif parse_url(self.hcom_url, "hcom_url", ("tcp",))[0] in WILDCARD_HOSTS:
            raise ConfigError(f"hcom_url: {self.hcom_url} binds every interface; set hcom_advertise_url to the "
                              f"address peers should use")
        check_range("checksum_verify_ratio", self.checksum_verify_ratio, 0, 1)
        check_int("shm_copy_threads", self.shm_copy_threads, 0, 64)
        if self.shm_copy_loop not in ("auto", "native", "python"):
            raise ConfigError(f"shm_copy_loop: expected auto, native or python, got {self.shm_copy_loop!r}")
        if self.segment_prefault not in ("auto", "on", "off"):
            raise ConfigError(f"segment_prefault: expected auto, on or off, got {self.segment_prefault!r}")
        check_bool("segment_hugepages", self.segment_hugepages)
        check_int("drain_timeout_ms", self.drain_timeout_ms, 0, 86_400_000)
        _check_disk(self)
        if self.ubs_io_enable:
            raise ConfigError("ubs_io_enable: the SSD tier is not supported yet; set it to false")


def check_etcd_auth(cfg: MetaConfig | LocalConfig, endpoints: str) -> None:
    """The ``ha_etcd_*`` credentials come in pairs, name files that exist, and https needs the CA."""
    for key in ("ha_etcd_ca_path", "ha_etcd_cert_path", "ha_etcd_key_path", "ha_etcd_password_path"):
        path = getattr(cfg, key)
        if not isinstance(path, str) or (path and not os.path.isfile(path)):
            raise ConfigError(f"{key}: no such file {path!r}")
    if bool(cfg.ha_etcd_cert_path) != bool(cfg.ha_etcd_key_path):
        raise ConfigError("ha_etcd_cert_path: a client certificate needs its key (ha_etcd_key_path), and a key its "
                          "certificate")
    if not isinstance(cfg.ha_etcd_user, str) or bool(cfg.ha_etcd_user) != bool(cfg.ha_etcd_password_path):
        raise ConfigError("ha_etcd_user: an etcd user needs ha_etcd_password_path (a file holding its password), "
                          "and a password file its user")
    if ("https://" in endpoints or cfg.ha_etcd_cert_path) and not cfg.ha_etcd_ca_path:
        raise ConfigError("ha_etcd_ca_path: etcd over https (an https:// endpoint or a client certificate) needs "
                          "the CA of etcd's server certificate")


def _check_transfer_engine(v: Any, tls_enable: bool) -> None:
    if v not in ("builtin", "nixl"):
        raise ConfigError(f"transfer_engine: expected 'builtin' or 'nixl', got {v!r}")
    if v == "nixl" and tls_enable:
        raise ConfigError("transfer_engine: 'nixl' moves payload outside TLS (UCX does not encrypt); "
                          "with tls_enable use 'builtin'")
    if v == "nixl" and importlib.util.find_spec("nixl") is None:
        raise ConfigError("transfer_engine: 'nixl' needs the nixl package "
                          "(pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1); it is not installed")


@dataclasses.dataclass
class ReplicateConfig:
    """Replica placement of a put (memcache_hybrid field names)."""

    replicaNum: int = 1  # noqa: N815 - memcache_hybrid's name
    """Copies of the object, each in a different segment (at most 8)."""
    preferredLocalServiceIDs: list[int] = dataclasses.field(default_factory=list)  # noqa: N815
    """LocalService ids to place replicas on first (unique, at most replicaNum)."""

    def validate(self) -> None:
        if isinstance(self.replicaNum, bool) or not isinstance(self.replicaNum, int) \
                or not 1 <= self.replicaNum <= 8:
            raise ConfigError(f"replicaNum: expected 1..8, got {self.replicaNum!r}")
        ids = list(self.preferredLocalServiceIDs)
        if len(set(ids)) != len(ids) or len(ids) > self.replicaNum:
            raise ConfigError("preferredLocalServiceIDs: ids must be unique and at most replicaNum")




def _check_disk(cfg: LocalConfig) -> None:
    check_str("disk_path", cfg.disk_path)
    size = parse_size(cfg.disk_size, "disk_size")
    parse_size(cfg.disk_write_limit, "disk_write_limit")
    if cfg.disk_write_policy not in DISK_WRITE_POLICIES:
        raise ConfigError(f"disk_write_policy: expected one of {', '.join(DISK_WRITE_POLICIES)}, "
                          f"got {cfg.disk_write_policy!r}")
    if cfg.disk_path and size < (1 << 20):
        raise ConfigError(f"disk_size: must be at least 1MB with disk_path set, got {cfg.disk_size!r}")


C = TypeVar("C", MetaConfig, LocalConfig)


def apply_dict(cfg: C, values: dict[str, Any], source: str = "config", strict: bool | None = None) -> C:
    """Set known fields from ``values``; then validate. An unknown key is named with the nearest known
    one: a warning, or with ``strict`` (default: ``$MEMCACHE_CONFIG_STRICT``) a ConfigError.

    All or nothing: the values are validated on a copy, and ``cfg`` changes only if they pass."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cfg)}
    setting = lambda name: values.get(name, getattr(cfg, name, None))  # noqa: E731 - the value it will have
    unknown = sorted(k for k, v in values.items() if k not in names and not ascend_keys.check(k, v, setting))
    if unknown:
        what = "; ".join(_unknown_key(k, names) for k in unknown)
        refuse = strict if strict is not None else strict_from_env()
        if refuse:
            raise ConfigError(f"{source}: unknown {type(cfg).__name__} keys: {what} (strict mode: "
                              f"{STRICT_ENV} is set; fix or remove them)")
        logger.warning("%s: ignoring unknown %s keys: %s", source, type(cfg).__name__, what)
    trial = dataclasses.replace(cfg, **{k: v for k, v in values.items() if k in names})
    trial.validate()
    for f in dataclasses.fields(cfg):
        setattr(cfg, f.name, getattr(trial, f.name))
    return cfg


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
    for f in dataclasses.fields(cls):
        var = ENV_PREFIX + f.name.upper()
        raw = os.environ.get(var)
        if raw is None:
            continue
        kind = str(f.type)
        if kind == "bool":
            out[f.name] = parse_bool(var, raw)
        elif kind in ("int", "float"):
            try:
                out[f.name] = int(raw, 0) if kind == "int" else float(raw)
            except ValueError:
                raise ConfigError(f"{var}: expected {'an integer' if kind == 'int' else 'a number'} "
                                  f"for {f.name}, got {raw!r}") from None
        elif "str" in kind:   # str, and sizes (int | str): "32GB" or "1073741824"
            out[f.name] = raw
        else:
            raise ConfigError(f"{var}: {f.name} cannot be set from the environment; set it in the config file")
    return out


def load_file(cls: type[C], path: str, strict: bool | None = None) -> C:
    """Build a config from a JSON file over the environment's overrides; a missing file or bad JSON
    raises ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except OSError as e:
        raise ConfigError(f"config_path: cannot read {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"config_path: {path} is not valid JSON: {e}") from e
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(values).__name__}")
    # one validation of both together: a pair of keys checked as one (hcom_url with hcom_advertise_url)
    # may come half from the environment, half from the file
    return apply_dict(cls(), {**env_overrides(cls), **values}, source=path, strict=strict)


def meta_config_from_env() -> MetaConfig:
    path = os.environ.get(META_CONFIG_ENV)
    return load_file(MetaConfig, path) if path else apply_dict(MetaConfig(), env_overrides(MetaConfig), "environment")


def local_config_from_env() -> LocalConfig:
    path = os.environ.get(LOCAL_CONFIG_ENV)
    return load_file(LocalConfig, path) if path else apply_dict(LocalConfig(), env_overrides(LocalConfig), "environment")


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
