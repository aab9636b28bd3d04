"""``MetaConfig``: the settings of the MetaService process, declared (``config_check.py``), with the
rules that read more than one of them. ``config.py`` re-exports it and loads it from files and the
environment."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Annotated, Any, Literal

from msgspec import Meta

from . import tls
from .config_check import NUMBER, Bool, Str, check, check_value
from .errors import ConfigError
from .values import check_cluster_id, check_log_level, parse_etcd_endpoints, parse_url


@dataclasses.dataclass
class MetaConfig:
    """Settings of the MetaService process."""

    meta_service_url: str = "tcp://127.0.0.1:5000"
    """Control-plane address LocalServices talk to (length-prefixed msgspec frames over TCP)."""
    config_store_url: str = "tcp://127.0.0.1:6000"
    """Small key-value store for rendezvous data (transfer-engine addresses)."""
    metrics_url: str = "http://127.0.0.1:8000"
    """HTTP admin server: /health, /metrics (Prometheus), key and segment queries."""
    ha_enable: Bool = False
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
    log_output_target: Literal["", "file", "stdout", "stderr"] = ""
    """Where the MetaService logs: ``file`` (under ``log_path``, which it then needs), ``stdout`` or
    ``stderr``; empty: ``file`` when ``log_path`` is set, else ``stderr``."""
    log_rotation_file_size: Annotated[int, Meta(ge=1, le=10240), NUMBER] = 20
    """MB per log file (under ``log_path``) before it is rotated, in [1, 10240]."""
    log_rotation_file_count: Annotated[int, Meta(ge=1, le=1000), NUMBER] = 50
    """Rotated log files kept beside the current one, in [1, 1000]."""
    evict_threshold_high: Annotated[float, Meta(ge=1, le=100)] = 90
    """Segment usage (percent) a put fills a segment up to without evicting; past it, LRU eviction (docs/design.md)."""
    evict_threshold_low: Annotated[float, Meta(ge=0, le=100)] = 80
    """Segment usage (percent) eviction brings a segment above its high mark down to; the gap to the high mark is what a put's pool-wide eviction frees."""
    evict_check_interval_seconds: Annotated[float, Meta(ge=0.01, le=3600)] = 5
    """How often every segment is checked against the high-water mark (puts check at once)."""
    lease_ttl_ms: Annotated[int, Meta(ge=10, le=3_600_000), NUMBER] = 10000
    """Read lease granted by lookup: the object is neither evicted nor its space reused meanwhile."""
    lru_shard_count: int = 16
    """Accepted for compatibility; the LRU here is one list per segment, their oldest compared across the pool."""
    defrag_evict_threshold: float = 70
    """Accepted for compatibility."""
    kv_events_enable: Bool = False
    """Publish "blocks stored" / "blocks removed" events on ``kv_events_endpoint`` (ZeroMQ PUB, vLLM's
    KV-event format; needs the ``events`` extra, pyzmq)."""
    kv_events_endpoint: str = "tcp://127.0.0.1:5557"
    """Where the KV-event PUB socket binds (tcp://HOST:PORT)."""
    kv_events_model_name: Str = ""
    """Model name put at the head of every KV-event topic."""
    kv_events_block_size: Annotated[int, Meta(ge=1, le=1 << 20), NUMBER] = 16
    """Tokens per block, carried in every BlockStored event."""
    kv_events_queue_size: Annotated[int, Meta(ge=1, le=10_000_000), NUMBER] = 100000
    """Events waiting to be sent; past it new events are dropped and counted, never waited for."""
    kv_events_replay_endpoint: Str = ""
    """ROUTER socket (tcp://HOST:PORT) that sends a late or lagging subscriber the batches it missed,
    as vLLM's publisher does; empty = no replay."""
    kv_events_buffer_steps: Annotated[int, Meta(ge=1, le=10_000_000), NUMBER] = 10000
    """Batches kept for replay."""
    kv_events_replay_requests_per_second: Annotated[int, Meta(ge=1, le=1_000_000), NUMBER] = 100
    """Replay requests read per second, all peers together; the rest wait in ZeroMQ's queue of their
    connection, read round robin (the live stream never waits for replays: docs/security.md)."""
    kv_events_replay_bytes_per_second: Annotated[int, Meta(ge=1024, le=1 << 40), NUMBER] = 32 << 20
    """Bytes of replayed batches sent per second, all replays together, each batch counted as at least
    1 KiB; a larger replay is sent over several seconds."""
    kv_events_replay_min_interval_ms: Annotated[int, Meta(ge=0, le=3_600_000), NUMBER] = 100
    """Least time between the starts of two replays of one peer (a ZeroMQ connection); a request sooner
    is dropped and counted, as is one while that peer's replay is still being sent."""
    zmq_enable_curve: Bool = False
    """Encrypt and authenticate the KV-event sockets with ZeroMQ CURVE: only subscribers whose public
    certificates are in ``zmq_curve_client_keys_dir`` get in."""
    zmq_curve_server_key_file: Str = ""
    """The publisher's secret CURVE certificate (``zmq.auth.create_certificates`` writes one)."""
    zmq_curve_client_keys_dir: Str = ""
    """Folder of the public CURVE certificates of the subscribers allowed in."""
    heartbeat_timeout_ms: Annotated[int, Meta(ge=100, le=3_600_000), NUMBER] = 10000
    """A LocalService silent this long is declared dead and its objects leave the table."""
    pending_timeout_ms: Annotated[int, Meta(ge=100, le=86_400_000), NUMBER] = 120000
    """A put allocated but not committed this long is aborted and its space reclaimed."""
    member_max_pending_objects: Annotated[int, Meta(ge=1, le=1 << 40), NUMBER] = 1 << 20
    """Objects one member may hold allocated and not committed; an Alloc beyond it is refused (-3112)."""
    member_max_pending_bytes: Annotated[int, Meta(ge=0, le=1 << 60), NUMBER] = 0
    """Payload bytes (times replicas) one member may hold allocated and not committed; 0: no bound but
    the pool's size. An Alloc beyond it is refused (-3112)."""
    member_max_objects: Annotated[int, Meta(ge=0, le=1 << 40), NUMBER] = 1 << 24
    """Objects one member may keep in the pool (committed objects it wrote, wherever they are, plus its
    puts in flight). At it, its own least recently used unleased objects are evicted for new ones;
    with none evictable, an Alloc is refused (-3112). 0: no bound. The default (16,777,216) bounds
    what one member makes the MetaService hold (2.5-5 GB of table, by key length: ~150-290 bytes an
    object) at what a 1 TiB pool holds of 64 KiB pages."""
    member_max_bytes: Annotated[int, Meta(ge=0, le=1 << 60), NUMBER] = 0
    """Payload bytes one member may keep in the pool (committed objects it wrote, counted once whatever
    their replicas, plus its puts in flight); an Alloc beyond it is refused (-3112). 0: no bound but the
    pool's size (its objects are evicted like any other's)."""
    max_members: Annotated[int, Meta(ge=1, le=1 << 24), NUMBER] = 65536
    """Members (LocalServices and clients) joined at once; a Join of a new member beyond it is refused
    (-3112). Each member gets its quotas, so this also bounds what joining again and again gets an
    insider; silent members leave after ``heartbeat_timeout_ms``."""
    member_max_leases: Annotated[int, Meta(ge=0, le=1 << 40), NUMBER] = 1 << 20
    """Leases one member may hold at once on the GVA path (``batch_add_lease``); a lease beyond it is
    refused (-3112) for that key. 0: no bound."""
    gva_lease_max_ms: Annotated[int, Meta(ge=10, le=86_400_000), NUMBER] = 60_000
    """The longest lease of the GVA path (``batch_add_lease``): a longer one asked for is granted this
    long (``lease_ttl_ms`` if that is longer); a reader holds an object longer only by leasing it
    again. Bounds how long one member's lease keeps an object from eviction."""
    arena_bytes: Annotated[int, Meta(ge=0, le=1 << 30), NUMBER] = 4 << 20
    """Size of the allocation arena granted to a LocalService in its own segment, where it places small
    puts itself and commits them in one round trip (docs/design.md, "Small puts"); at most an eighth
    of the segment. 0: no arenas, every put is two-phase."""
    auth_enable: Bool = True
    """Every connection proves it holds the pool secret (HMAC challenge-response) before anything
    else; false only for a single trusted host (docs/security.md)."""
    auth_secret_path: Str = ""
    """File holding the pool secret; empty = $MEMCACHE_SECRET_PATH, else the pool's default file
    (``pool_name``), which a MetaService creates (0600) when it is missing."""
    pool_name: Str = ""
    """Names the pool: its default secret file is ~/.config/memcache/pool-<pool_name>.secret, so two
    pools of one user on one host do not share a secret. 1-64 letters, digits, '_', '.' or '-';
    empty: the user's one default file for unnamed pools (pool.secret). Set it alike on the
    MetaService and its members; auth_secret_path and $MEMCACHE_SECRET_PATH take precedence."""
    config_store_max_value_bytes: Annotated[int, Meta(ge=1, le=1 << 30), NUMBER] = 1 << 20
    """Largest value the config store accepts."""
    config_store_max_total_bytes: Annotated[int, Meta(ge=1, le=1 << 34), NUMBER] = 64 << 20
    """Most bytes (keys and values) the config store holds."""
    tls_enable: bool = False
    """Encrypt the control, config-store, data and admin planes with TLS (docs/security.md)."""
    tls_ca_path: str = ""
    """CA certificate (PEM) that signed every member's certificate."""
    tls_cert_path: str = ""
    """This process's certificate (PEM), signed by the pool's CA."""
    tls_key_path: str = ""
    """The private key of ``tls_cert_path`` (PEM)."""
    max_connections: Annotated[int, Meta(ge=16, le=1 << 20), NUMBER] = 4096
    """Connections the control plane keeps open at once; more are refused."""
    max_connections_per_address: Annotated[int, Meta(ge=1, le=1 << 20), NUMBER] = 512
    """Control-plane connections one source address may hold open at once (authenticated or not);
    more are refused, so one host's processes cannot take every slot. Above what a host's members
    open (a store keeps at most 8)."""
    idle_timeout_seconds: Annotated[float, Meta(ge=1, le=86400 * 7)] = 600
    """A control-plane connection silent this long is closed (a client reconnects on its next call)."""
    poll_spin_us: Annotated[int, Meta(ge=0, le=100_000)] = 0
    """After serving requests the control plane polls for more this long before it sleeps: a request
    arriving meanwhile does not pay the wake-up of an idle core (0: sleep at once)."""
    frame_loop: Literal["auto", "native", "python"] = "auto"
    """Who serves authenticated plain-TCP control-plane connections after their handshake: native (the
    C frame pump; the MetaService fails at start where it is not built), python, or auto (native where
    built and its self-test passes)."""
    placement_policy: Literal["local_first", "spread", "random"] = "local_first"
    """Where new objects go: local_first (the writer's own segment, then as spread; a writer without a
    segment gets spread), spread (most free ratio first, the better of two random picks), or random.
    A put's preferredLocalServiceIDs come first under every policy (docs/design.md, Allocation)."""
    drain_timeout_ms: Annotated[int, Meta(ge=100, le=86_400_000)] = 60000
    """Longest a drain started with ``POST /drain/<segment_id>`` may take (a drain a leaving
    LocalService starts is bounded by its own ``drain_timeout_ms``)."""
    repair_enable: Bool = True
    """Re-replication: an object with fewer replicas than its put asked for (a holder died, a copy was
    corrupt, the put found too few segments with room) is copied again by a surviving holder to a
    segment with room below the high-water mark, hosts without a replica first (docs/design.md)."""
    stats_sample_interval_seconds: Annotated[float, Meta(ge=0.1, le=3600)] = 5
    """How often the counters are sampled for the status page's chart (the last 120 samples are kept)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every field against its declaration, then the rules that read several (``META_RULES``)."""
        check(self)
        for rule in META_RULES:
            rule(self)


def _urls(cfg: MetaConfig) -> None:
    parse_url(cfg.meta_service_url, "meta_service_url", ("tcp",))
    parse_url(cfg.config_store_url, "config_store_url", ("tcp",))
    parse_url(cfg.metrics_url, "metrics_url", ("http", "https"))


HA_LEASE_TTL_MS = Annotated[int, Meta(ge=2000, le=600_000), NUMBER]   # read (and checked) with ha_enable only


def _ha(cfg: MetaConfig) -> None:
    """With ``ha_enable``: etcd endpoints, a cluster id, a lease of whole seconds (unread without it)."""
    if cfg.pool_name:
        check_cluster_id(cfg.pool_name, "pool_name")
    if not cfg.ha_enable:
        return
    parse_etcd_endpoints(cfg.ha_etcd_endpoints, "ha_etcd_endpoints")
    check_etcd_auth(cfg, cfg.ha_etcd_endpoints)
    check_cluster_id(cfg.ha_cluster_id, "ha_cluster_id")
    check_value("ha_lease_ttl_ms", HA_LEASE_TTL_MS, cfg.ha_lease_ttl_ms)
    if cfg.ha_lease_ttl_ms % 1000:
        raise ConfigError(f"ha_lease_ttl_ms: etcd leases count whole seconds; got {cfg.ha_lease_ttl_ms}")


def _log_output(cfg: MetaConfig) -> None:
    if cfg.log_output_target == "file" and not cfg.log_path:
        raise ConfigError("log_output_target: 'file' needs log_path (the directory of the log file)")


def check_etcd_auth(cfg: Any, endpoints: str) -> None:
    """The ``ha_etcd_*`` credentials (of a MetaConfig or a LocalConfig) come in pairs, name files that
    exist, and https needs the CA."""
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


def _eviction_marks(cfg: MetaConfig) -> None:
    if cfg.evict_threshold_low >= cfg.evict_threshold_high:
        raise ConfigError(
            f"evict_threshold_low: must be below evict_threshold_high "
            f"({cfg.evict_threshold_low} >= {cfg.evict_threshold_high})")


def _kv_events(cfg: MetaConfig) -> None:
    """With ``kv_events_enable``: an endpoint to bind and pyzmq installed."""
    if not cfg.kv_events_enable:
        return
    parse_url(cfg.kv_events_endpoint, "kv_events_endpoint", ("tcp",))
    if cfg.kv_events_replay_endpoint:
        parse_url(cfg.kv_events_replay_endpoint, "kv_events_replay_endpoint", ("tcp",))
        if cfg.kv_events_replay_endpoint == cfg.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint: must differ from kv_events_endpoint "
                              f"({cfg.kv_events_endpoint}); give the replay socket its own port")
    if cfg.zmq_enable_curve:
        for key in ("zmq_curve_server_key_file", "zmq_curve_client_keys_dir"):
            if not getattr(cfg, key):
                raise ConfigError(f"{key}: needed with zmq_enable_curve (docs/operations.md#kv-events)")
        if not os.path.isdir(cfg.zmq_curve_client_keys_dir):
            raise ConfigError(f"zmq_curve_client_keys_dir: {cfg.zmq_curve_client_keys_dir!r} is not a "
                              "folder; put the subscribers' public certificates (*.key) in one")
    try:
        import zmq  # noqa: F401
    except ImportError as e:
        raise ConfigError("kv_events_enable: needs pyzmq (the events extra: pip install pyzmq, or the wheel with "
                          "[events]; docs/operations.md, Install)") from e


META_RULES: tuple[Callable[[MetaConfig], None], ...] = (
    _urls, _ha, lambda cfg: check_log_level(cfg.log_level), _log_output, _eviction_marks, tls.check, _kv_events)
