"""A remove and a re-put acknowledged right before the MetaService is killed (kill -9), or the HA leader
is: after the restart or failover every key reads as its newest acknowledged value, byte-exact, never
an older one (docs/design.md, "Failure of the MetaService").

Each round, for a few keys: a reader leases the current values (and checks them), the keys are removed,
put again with the next version on the other provider (the old space is still leased), and the
MetaService (or the leader) is killed at once. Every other round removes through the raw control
plane, which does not wait for the owners to clear the old headers: the old holder then re-joins with
the older generation, and recovery must keep the newer one (``superseded_total`` counts it). Values
are derived from key and version (``store_worker.get_versions``).
"""

from __future__ import annotations

import random
import tempfile
import time
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
    """The keys, their newest acknowledged versions, and one round of lease, remove, re-put."""

    def __init__(self, a: StoreProcess, b: StoreProcess) -> None:
        self.a, self.b = a, b
        self.holders = [a("id")["id"], b("id")["id"]]
        self.keys = [f"gen-{random.getrandbits(32):x}-{i}" for i in range(KEYS)]
        self.acked: dict[str, int] = {}
        self.version = 0
        codes = a("put", keys=self.keys, layout=LAYOUT, version=0, preferred=self.holders[:1])["codes"]
        assert codes == [0] * KEYS
        self.acked = dict.fromkeys(self.keys, 0)

    def check(self) -> None:
        """Every key reads as its newest acknowledged version, byte-exact, from both stores: never an
        older one, and (both providers are alive) never a miss."""
        for reader in (self.a, self.b):
            got = reader("get_versions", keys=self.keys, layout=LAYOUT, upto=self.version)
            seen = dict(zip(self.keys, got["versions"], strict=True))
            assert seen == self.acked, f"read {seen}, newest acknowledged {self.acked} (round {self.version})"

    def next(self, remove: Callable[[list[str]], list[int]]) -> None:
        """Lease the values (a reader), remove them, put the next version on the other provider."""
        self.check()                               # b's read leases every key's current object
        assert remove(self.keys) == [0] * KEYS
        self.version += 1
        target, left = self.holders[self.version % 2], list(self.keys)

        def put() -> bool:
            """Put the keys not stored yet; right after a recovery the re-joined segments take no new
            object until the previous MetaService's leases would have ended (-3016 meanwhile)."""
            nonlocal left
            codes = self.a("put", keys=left, layout=LAYOUT, version=self.version, preferred=[target])["codes"]
            assert set(codes) <= {0, errors.OUT_OF_MEMORY}, codes
            self.acked.update((k, self.version) for k, c in zip(left, codes, strict=True) if c == 0)
            left = [k for k, c in zip(left, codes, strict=True) if c != 0]
            return not left

        wait_for(put, 15, "the re-put of every key to be acknowledged")


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
    rounds_n = 10
    with running_meta_service(heartbeat_timeout_ms=3000, lease_ttl_ms=1000) as ms:
        a = StoreProcess(ms, heartbeat_interval_ms=300)
        b = StoreProcess(ms, heartbeat_interval_ms=300)
        try:
            rounds, superseded = Rounds(a, b), 0.0
            t0 = time.monotonic()
            for i in range(rounds_n):
                rounds.next(raw_remove(ms) if i % 2 else lambda keys: b("remove", keys=keys)["codes"])
                ms.kill()                          # right after the acknowledged re-put
                ms.start()
                wait_for(lambda: len(ms.http("/get_all_segments")["segments"]) == 2, 15,
                         "both providers to re-join the restarted MetaService")
                superseded += ms.metric("superseded_total")
                rounds.check()
            rounds.check()
            # the raw removes left the older headers in place (the owners had not heard yet) at least
            # once: recovery met both generations and kept the newer
            assert superseded > 0, "no round exercised two generations of a key at recovery"
            assert time.monotonic() - t0 < 90
        finally:
            a.stop()
            b.stop()


@pytest.fixture
def ha_pool() -> Iterator[Pool]:
    with tempfile.TemporaryDirectory(prefix="memcache-ha-") as d:
        pl = Pool(d)
        try:
            yield pl
        finally:
            pl.close()


def test_leader_kill_after_an_acknowledged_remove_and_re_put_never_brings_back_the_older_value(ha_pool):
    pool = ha_pool
    a = pool.store(pool.etcd_url)
    b = pool.store(pool.etcd_url)
    rounds, superseded = Rounds(a, b), 0.0
    for i in range(6):
        leader = pool.leader()
        rounds.next(raw_remove(leader) if i % 2 else lambda keys: b("remove", keys=keys)["codes"])
        leader.kill()
        rest = [m for m in pool.metas if m is not leader]
        new = pool.leader(TTL_S + 5, rest)
        leader.start()                             # a standby again: three MetaServices for the next round
        wait_for(lambda m=new: len(m.http("/get_all_segments")["segments"]) == 2, 20,  # type: ignore[misc]
                 "both providers to re-join the new leader")
        superseded += new.metric("superseded_total")
        rounds.check()
    assert superseded > 0, "no round exercised two generations of a key at recovery"


def test_generation_reservations_in_etcd_order_leader_terms_without_clocks():
    """Scenario: leader 1 reserves a block and issues from it; leader 2 is elected on a host whose
    clock is far behind (its floor is below leader 1's generations). Leader 2 still starts above
    every generation leader 1 could issue, and leader 1, paused meanwhile, can reserve no more."""
    from memcache_core.errors import MetaServiceUnavailable
    from memcache_core.etcd import Etcd
    from memcache_core.meta.generations import BLOCK
    from memcache_core.meta.ha import GenerationReservation
    from memcache_core.testing import EtcdProcess

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
