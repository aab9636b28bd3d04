"""HA MetaService: leader election through etcd, and fencing.

Every MetaService with ``ha_enable`` campaigns for the leased key ``/memcache/<cluster_id>/leader``
(create-if-absent under a fresh lease). The winner's term is the key's create revision: etcd makes
it strictly increasing. The leader renews its lease every quarter TTL; standbys watch the key and
campaign again when it goes (the lease lapsed: the leader died, paused or lost etcd).

Fencing: the leader serves only until 3/4 of the TTL after the start of its last successful renewal
(the lease lives at least a full TTL from then, as etcd counts), so it stops before any standby can
win. At every renewal it also reads the key back: deleted, or rewritten under another lease (by an
operator, or by anyone etcd lets write it), it steps down at once instead of serving on for good
beside the next winner. And a winner that replaces a holder whose lease is still alive (the key
went, the holder did not) waits out that holder's serving window (3/4 TTL) before it serves: the old
leader notices within a quarter TTL, so two leaders never answer at once, and nothing it
acknowledged is lost (members re-join the new one only after it stopped). Standbys, and a leader
past that deadline, answer every control request with NOT_LEADER; every
reply carries the term, and clients refuse replies of an older term (``rpc/client.py``). A MetaService that
wins starts from an empty table (a new epoch): the LocalServices re-join and report their objects,
as after a restart. The config store lives in etcd (``config/<key>``), read back on winning.
Generations are reserved in etcd (``generations``, compare-and-swap: ``GenerationReservation``), so a
new leader issues above every generation an earlier leader could issue (``meta/generations.py``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import errors
from .. import protocol as p
from ..config import MetaConfig, parse_etcd_endpoints
from ..etcd import Etcd, EtcdAuth, config_prefix, generations_key, leader_key
from .generations import BLOCK

if TYPE_CHECKING:
    from .service import MetaServiceCore

logger = logging.getLogger(__name__)

SERVE_FRACTION = 0.75    # serve until this fraction of the TTL after the start of the last renewal
RENEW_FRACTION = 0.25    # renew every quarter TTL
RETRY_S = 0.1            # etcd unreachable: try again this often


class LeaderElection:
    def __init__(self, config: MetaConfig, on_change: Callable[[bool], None]) -> None:
        self.config = config
        self.ttl_s = config.ha_lease_ttl_ms // 1000
        self.etcd = Etcd(parse_etcd_endpoints(config.ha_etcd_endpoints, "ha_etcd_endpoints"),
                         timeout_s=self.ttl_s * RENEW_FRACTION, auth=EtcdAuth.of(config))
        self.key = leader_key(config.ha_cluster_id)
        self.urls = {"control": config.meta_service_url, "config_store": config.config_store_url,
                     "admin": config.metrics_url, "pid": os.getpid()}
        self.on_change = on_change        # forget the table: on_change(True) before winning, (False) after losing
        self.term = 0                     # > 0 while this MetaService holds the leader key
        self.valid_until = 0.0            # monotonic: serve only before this
        self.serve_from = 0.0             # monotonic: and not before this (a previous holder's window)
        self._seen_lease = 0              # the lease of the last holder of the key seen as a standby
        self.leader: dict[str, Any] | None = None   # the leader record last read from etcd
        self.etcd_ok = False
        self._lease = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meta-ha", daemon=True)

    def serving(self) -> bool:
        return self.term > 0 and self.serve_from <= time.monotonic() < self.valid_until

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Give the key up at once (a clean shutdown lets a standby take over without waiting)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.ttl_s)
        if self.term:
            self.term = 0
            try:
                self.etcd.revoke(self._lease)
            except Exception as e:  # noqa: BLE001 - best effort: the lease lapses anyway
                logger.warning("could not revoke the leader lease: %s", e)

    def status(self) -> dict[str, Any]:
        return {"role": "leader" if self.serving() else "standby", "term": self.term if self.serving() else 0,
                "cluster_id": self.config.ha_cluster_id, "etcd_reachable": self.etcd_ok,
                "lease_ttl_s": self.ttl_s, "leader": self.leader}

    def store_config(self, key: str, value: bytes) -> None:
        self.etcd.call(lambda c: c.put(config_prefix(self.config.ha_cluster_id) + key, value))

    def load_config(self) -> dict[str, bytes]:
        return self.etcd.get_prefix(config_prefix(self.config.ha_cluster_id))

    # ---- the election loop ----------------------------------------------------------------------

    def _run(self) -> None:
        warned = False
        while not self._stop.is_set():
            try:
                if self.term:
                    self._renew()
                else:
                    self._campaign()
                self.etcd_ok, warned = True, False
            except Exception as e:  # noqa: BLE001 - etcd down or slow: keep trying, never die
                self.etcd_ok = False
                if not warned:
                    logger.warning("etcd: %s: %s (%s)", type(e).__name__, e,
                                   "leader: serving until the lease deadline" if self.term else "standby")
                    warned = True
                self._stop.wait(RETRY_S)

    def _renew(self) -> None:
        t0 = time.monotonic()
        ttl = self.etcd.refresh(self._lease)
        if ttl <= 0:
            logger.error("lost the leader lease (term %d): it expired before a renewal got through; "
                         "standing by", self.term)
            self._step_down()
            return
        got = self.etcd.read(self.key)
        if got is None or got[1]["lease"] != self._lease or got[1]["create_revision"] != self.term:
            logger.error("the leader key %s was %s (term %d): stepping down at once", self.key,
                         "deleted" if got is None else f"rewritten under lease {got[1]['lease']:x}, create revision "
                         f"{got[1]['create_revision']}", self.term)
            self._step_down()
            try:
                self.etcd.revoke(self._lease)   # nothing is attached to it any more
            except Exception as e:  # noqa: BLE001 - best effort: it lapses anyway
                logger.warning("could not revoke the old leader lease: %s", e)
            return
        self.valid_until = t0 + SERVE_FRACTION * min(ttl, self.ttl_s)
        self._stop.wait(self.ttl_s * RENEW_FRACTION)

    def _step_down(self) -> None:
        self.term = 0
        self.valid_until = 0.0
        self.on_change(False)

    def _campaign(self) -> None:
        t0 = time.monotonic()
        lease = self.etcd.grant(self.ttl_s)
        won = self.etcd.call(lambda c: c.create(self.key, json.dumps(self.urls),
                                                lease=_lease(c, lease)))
        got = self.etcd.read(self.key)
        self.etcd_ok = True
        if won and got is not None and got[1]["lease"] == lease:
            self._lease = lease
            self.on_change(True)                   # a fresh table: members re-join and report
            self.serve_from = self._previous_window_end()
            self.valid_until = t0 + SERVE_FRACTION * self.ttl_s
            self.term = got[1]["create_revision"]
            self.leader = {**self.urls, "term": self.term}
            self.etcd.call(lambda c: c.put(self.key, json.dumps(self.leader), lease=_lease(c, lease)))
            logger.info("elected leader of cluster %r, term %d", self.config.ha_cluster_id, self.term)
            return
        self.etcd.revoke(lease)
        if got is None:
            return   # the key went meanwhile: campaign again at once
        self._seen_lease = got[1]["lease"]
        try:
            self.leader = {**json.loads(got[0]), "term": got[1]["create_revision"]}
        except ValueError:
            self.leader = None
        self._watch(got[1]["mod_revision"])

    def _previous_window_end(self) -> float:
        """When the previous holder surely stopped serving: now if its lease is gone (it expired or
        was revoked), else 3/4 TTL from now (its serving window; it checks the key every quarter TTL)."""
        prev, self._seen_lease = self._seen_lease, 0
        if prev and self.etcd.call(lambda c: _lease(c, prev).ttl()) <= 0:
            return 0.0
        wait = SERVE_FRACTION * self.ttl_s
        logger.warning("won the leader key while %s: serving only in %.1f s, once any old leader has "
                       "stepped down", f"the previous holder's lease {prev:x} is alive" if prev else
                       "the previous holder is unknown", wait)
        return time.monotonic() + wait

    def _watch(self, revision: int) -> None:
        """Wait until the leader key changes after ``revision`` (or a TTL passed: look again)."""
        from etcd3gw.exceptions import WatchTimedOut  # type: ignore[import-untyped]
        try:
            self.etcd.call(lambda c: c.watch_once(self.key, timeout=self.ttl_s, start_revision=revision + 1))
        except WatchTimedOut:
            pass


class GenerationReservation:
    """The table's ``reserve`` under HA: each block of generations is reserved in etcd before any of
    it is issued. One per term: its first reservation starts above whatever is stored (an earlier
    leader's ceiling), the later ones continue its own; a swap that finds another value (another
    leader reserved meanwhile) fails, and so does the alloc that needed it."""

    def __init__(self, etcd: Etcd, cluster_id: str) -> None:
        self.etcd = etcd
        self.key = generations_key(cluster_id)
        self._mine: bytes | None = None     # the value this term last wrote

    def __call__(self, last: int, ceiling: int) -> tuple[int, int]:
        got = self.etcd.read(self.key)
        stored = got[0] if got is not None else None
        if self._mine is not None and stored != self._mine:
            raise _taken()
        if stored is not None and self._mine is None:   # this term's first block: above every earlier one
            try:
                last = max(last, int(stored))
            except ValueError as e:
                raise errors.MetaServiceUnavailable(f"etcd key {self.key} holds {stored!r}, not a "
                                                    "generation; delete it to let the leader reserve again") from e
        new = str(max(last, ceiling) + BLOCK).encode()
        ok = self.etcd.call(lambda c: c.create(self.key, new) if stored is None else c.replace(self.key, stored, new))
        if not ok:
            raise _taken()
        self._mine = new
        return last, int(new)


def _taken() -> errors.MetaServiceUnavailable:
    return errors.MetaServiceUnavailable("another MetaService reserved generations meanwhile: this one is no "
                                         "longer the leader")


def _lease(client: Any, lease_id: int) -> Any:
    from etcd3gw import Lease  # type: ignore[import-untyped]
    return Lease(lease_id, client)


def reset(core: MetaServiceCore, election: LeaderElection, won: bool) -> None:
    """Forget the table, members and epoch (new ones, as a restarted MetaService has). On winning,
    the config store is read back from etcd first (a failure there aborts the win)."""
    from .members import new_epoch
    table = core.fresh_table()
    if won:
        table.reserve = GenerationReservation(election.etcd, election.config.ha_cluster_id)
    store = election.load_config() if won else {}
    with core.lock:
        core.epoch, core.table, core.members = new_epoch(), table, {}
        core.config_store = store
        core.config_store_bytes = sum(len(k) + len(v) for k, v in store.items())
    logger.info("table reset (epoch %d)%s", core.epoch,
                f"; {len(store)} config-store keys read from etcd" if won else "")


def fenced(election: LeaderElection, answer: Callable[[bytes, int], bytes]) -> Callable[[bytes], bytes]:
    """The control-plane handler: the leader answers (stamped with its term); all others refuse."""
    def handle(body: bytes) -> bytes:
        term = election.term
        if not election.serving():
            leader = election.leader
            where = f"; the leader is at {leader.get('control')} (term {leader.get('term')})" if leader else ""
            return p.request_encoder.encode(p.Error(errors.NOT_LEADER, f"MetaService at {election.urls['control']} "
                                                                      f"is not the leader{where}", term=term))
        return answer(body, term)
    return handle
