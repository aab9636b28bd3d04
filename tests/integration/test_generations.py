"""A remove and a re-put acknowledged right before the MetaService is killed (kill -9), or the HA leader
is: after the restart or failover every key reads as its newest acknowledged value, byte-exact, never
an older one (docs/design.md, "Failure of the MetaService").

Each round, for a few keys: a reader (a pure client) leases the current values and checks them, the
keys are removed and put again with the next version on the other of two providers (the old space is
still leased), and the MetaService (or the leader) is killed at once. Rounds alternate between:

* a store's ``remove``, which returns once the old holder cleared the headers; the old holder is
  frozen (SIGSTOP) as soon as it returns, so nothing is cleared after that: after the restart the
  old holder reports nothing of those keys (``superseded_total`` stays 0);
* a remove through the raw control plane while the old holder is frozen, so it cannot have cleared
  them: recovery meets the older generation first and must replace it by the newer
  (``superseded_total`` counts every key).

Both holders are frozen across the kill, and the old one is let re-join first.

Values are derived from key and version (``store_worker.get_versions``).
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
from collections.abc import Callable, Iterator

import pytest

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.rpc import expect
from memcache_core.testing import MetaServiceProcess, running_meta_service, wait_for
from tests.integration.stores import StoreProcess
from tests.integration.test_ha import TTL_S, Pool

pytestmark = pytest.mark.integration

LAYOUT = [32 << 10] * 2
KEYS = 6


class Rounds:
    """The keys, their newest acknowledged versions, and one round of lease, remove, re-put, kill."""

    def __init__(self, reader: StoreProcess, holders: list[StoreProcess]) -> None:
        self.reader, self.holders = reader, holders
        self.ids = [h("id")["id"] for h in holders]
        self.keys = [f"gen-{random.getrandbits(32):x}-{i}" for i in range(KEYS)]
        self.version = 0
        self.acked: dict[str, int] = {}
        self._put(self.ids[0])

    def check(self) -> None:
        """Every key reads as its newest acknowledged version, byte-exact: never an older one, and
        (both providers are alive) never a miss."""
        got = self.reader("get_versions", keys=self.keys, layout=LAYOUT, upto=self.version)
        seen = dict(zip(self.keys, got["versions"], strict=True))
        assert seen == self.acked, (f"read {seen} (codes {got['codes']}), newest acknowledged {self.acked} "
                                    f"(version {self.version})")

    def reach(self) -> None:
        """Wait until the reader's calls get through again. It saw the MetaService (or the leader) go:
        its calls fail at once (-3017, or -3120 from a MetaService that no longer leads), one every
        0.2 s trying again, until an exchange succeeds (docs/design.md, "Failure of the MetaService").
        Such a code is no answer about the keys; anything else is, and ``check`` judges it."""
        unanswered = {errors.META_NOT_CONNECTED, errors.NOT_LEADER}
        wait_for(lambda: not unanswered & set(self.reader("exist", keys=self.keys)["codes"]), 10,
                 "the reader to reach the MetaService again")

    def _put(self, target: int) -> None:
        left = list(self.keys)

        def put() -> bool:
            """Put the keys not stored yet; right after a recovery the re-joined segments take no new
            object until the previous MetaService's leases would have ended (-3016 meanwhile)."""
            nonlocal left
            codes = self.reader("put", keys=left, layout=LAYOUT, version=self.version, preferred=[target])["codes"]
            assert set(codes) <= {0, errors.OUT_OF_MEMORY}, codes
            self.acked.update((k, self.version) for k, c in zip(left, codes, strict=True) if c == 0)
            left = [k for k, c in zip(left, codes, strict=True) if c != 0]
            return not left

        wait_for(put, 15, "the put of every key to be acknowledged")

    def run(self, durable: bool, control: Callable[[], MetaServiceProcess],
            restart: Callable[[], MetaServiceProcess]) -> None:
        """One round; ``control()`` is the MetaService answering now, ``restart()`` kills it and
        returns the one answering afterwards."""
        self.check()                               # the reader's lookups lease every key's current object
        old, new = self.holders[self.version % 2], self.holders[(self.version + 1) % 2]
        if durable:
            assert self.reader("remove", keys=self.keys)["codes"] == [0] * KEYS
            os.kill(old.proc.pid, signal.SIGSTOP)   # what it cleared before remove returned stays cleared
        else:
            os.kill(old.proc.pid, signal.SIGSTOP)   # it cannot hear of the removal
            assert raw_remove(control())(self.keys) == [0] * KEYS
        self.version += 1
        self._put(self.ids[self.version % 2])
        os.kill(new.proc.pid, signal.SIGSTOP)
        ms = restart()                             # kill -9 right after the acknowledged re-put
        for h in (old, new):                       # the older holder re-joins first
            os.kill(h.proc.pid, signal.SIGCONT)
            sid = self.ids[self.holders.index(h)]
            wait_for(lambda s=sid: any(g["segment_id"] == s  # type: ignore[misc]
                                       for g in ms.http("/get_all_segments")["segments"]), 15,
                     "the frozen holder to re-join")
        wait_for(lambda: len(ms.http("/get_all_segments")["segments"]) == 2, 15,
                 "both providers to re-join")
        self.reach()
        self.check()
        superseded = ms.metric("superseded_total")
        assert superseded == (0 if durable else KEYS), (durable, superseded)


def raw_remove(ms: MetaServiceProcess) -> Callable[[list[str]], list[int]]:
    """A remove that returns as soon as the MetaService has taken the objects out of its table (the
    owners clear the headers on their next heartbeat): the window a crash could fall into."""
    def remove(keys: list[str]) -> list[int]:
        client = ms.rpc()
        try:
            return expect(client.call(p.Remove(keys)), p.Codes).codes
        finally:
            client.close()
    return remove


def test_kill9_after_an_acknowledged_remove_and_re_put_never_brings_back_the_older_value():
    with running_meta_service(heartbeat_timeout_ms=5000, lease_ttl_ms=1000) as ms:
        holders = [StoreProcess(ms, heartbeat_interval_ms=200) for _ in range(2)]
        reader = StoreProcess(ms, init_bm=False)

        def restart() -> MetaServiceProcess:
            ms.kill()
            return ms.start()

        try:
            rounds = Rounds(reader, holders)
            for i in range(8):
                rounds.run(durable=i % 2 == 0, control=lambda: ms, restart=restart)
        finally:
            for s in (reader, *holders):
                if s.proc.poll() is None:
                    os.kill(s.proc.pid, signal.SIGCONT)
                s.stop()


@pytest.fixture
def ha_pool() -> Iterator[Pool]:
    with tempfile.TemporaryDirectory(prefix="memcache-ha-") as d:
        pl = Pool(d)
        try:
            yield pl
        finally:
            for s in pl.stores:
                if s.proc.poll() is None:
                    os.kill(s.proc.pid, signal.SIGCONT)
            pl.close()


def test_leader_kill_after_an_acknowledged_remove_and_re_put_never_brings_back_the_older_value(ha_pool):
    pool = ha_pool
    pool.leader()   # a pool's first leader serves only after 3/4 of the lease TTL (meta/ha.py); NOT_LEADER before
    holders = [pool.store(pool.etcd_url) for _ in range(2)]
    reader = pool.store(pool.etcd_url, init_bm=False)

    def restart() -> MetaServiceProcess:
        leader = pool.leader()
        leader.kill()
        new = pool.leader(TTL_S + 5, [m for m in pool.metas if m is not leader])
        leader.start()                             # a standby again, for the next rounds
        return new

    rounds = Rounds(reader, holders)
    for i in range(4):
        rounds.run(durable=i % 2 == 0, control=pool.leader, restart=restart)


def test_generation_reservations_in_etcd_order_leader_terms_without_clocks():
    """Scenario: leader 1 reserves a block and issues from it; leader 2 is elected on a host whose
    clock is far behind (its floor is below leader 1's generations). Leader 2 still starts above
    every generation leader 1 could issue, and leader 1, paused meanwhile, can reserve no more."""
    from memcache_core.errors import MetaServiceUnavailable
    from memcache_core.etcd import Etcd
    from memcache_core.meta.generations import BLOCK
    from memcache_core.meta.ha import GenerationReservation
    from memcache_core.testing_etcd import EtcdProcess

    with tempfile.TemporaryDirectory(prefix="memcache-etcd-") as d:
        etcd = EtcdProcess(d).start()
        try:
            client = Etcd((("127.0.0.1", etcd.port),), timeout_s=5.0)
            cluster = f"g{random.getrandbits(32):x}"
            first = GenerationReservation(client, cluster)
            last1, ceiling1 = first(10 << 40, 0)
            assert ceiling1 == (10 << 40) + BLOCK
            last1, ceiling1 = first(ceiling1 - BLOCK // 2, ceiling1)     # its next block continues its own
            assert ceiling1 == (10 << 40) + 2 * BLOCK
            second = GenerationReservation(client, cluster)
            last2, ceiling2 = second(1 << 40, 0)                          # a clock far behind
            assert last2 >= ceiling1 and ceiling2 == ceiling1 + BLOCK     # above all leader 1 could issue
            with pytest.raises(MetaServiceUnavailable):
                first(ceiling1 - BLOCK // 2, ceiling1)                    # the old leader's swap fails
        finally:
            etcd.stop()
