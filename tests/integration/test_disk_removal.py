"""An acknowledged remove covers the disk tier: after the provider holding the removed objects' disk
records is killed (kill -9) and started again on its ``disk_path``, a removed key reads as a miss, or
as the newest acknowledged put after the removal, never as the removed value (docs/design.md,
"Failure of the MetaService" and "Disk tier").

Provider A has a ``write_through`` disk tier and a data-server port of its own, which each incarnation
binds again (readers find a restarted A on the address of the dead one); provider B has no disk tier
(re-puts go there). Each round puts fresh keys on A, waits until every one has its disk record, lets
a reader (a pure client) lease and check them, removes all but two (the controls, which must survive
every restart: they prove a restarted A does bring its records back), and kills and restarts A.
Rounds cycle through:

* ``remove``: a store's ``remove`` returns 0, then A is killed at once;
* ``re-put``: the same, and the keys are put again with the next version on B before the kill;
* ``frozen``: A is frozen (SIGSTOP) so it cannot hear of the removal; the remove returns once A is
  declared dead; A is killed and restarted while the remove is still waiting (its new incarnation
  joins beside the old one, which the MetaService has not declared dead yet);
* ``dead``: the same, but A is restarted only after the remove returned (the old one declared dead).

Every key of every round so far is checked after each restart: values derive from key and version
(``store_worker.get_versions``).
"""

from __future__ import annotations

import os
import random
import signal
import threading
from typing import Any

import pytest

from memcache_core.testing import MetaServiceProcess, free_port, running_meta_service, wait_for
from tests.integration.stores import StoreProcess

pytestmark = pytest.mark.integration

LAYOUT = [32 << 10] * 2
REMOVED, CONTROLS = 6, 2
KINDS = ("remove", "re-put", "frozen", "dead")


class DiskRemovals:
    def __init__(self, ms: MetaServiceProcess, disk: str) -> None:
        self.ms, self.disk = ms, disk
        self.hcom_url = f"tcp://127.0.0.1:{free_port()}"
        self.a = self._provider()
        self.b = StoreProcess(ms, dram_size="32MB")
        self.reader = StoreProcess(ms, init_bm=False, client_timeout_seconds=20)
        self.version = 0
        self.expected: dict[str, int | None] = {}   # key -> newest acknowledged version (None: removed)
        self.tag = f"{random.getrandbits(32):x}"

    def _provider(self) -> StoreProcess:
        return StoreProcess(self.ms, dram_size="32MB", disk_path=self.disk, disk_size="64MB",
                            disk_write_policy="write_through", hcom_url=self.hcom_url)

    def close(self) -> None:
        for s in (self.reader, self.a, self.b):
            if s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)
            s.stop()

    def check(self) -> None:
        """Every key reads as its newest acknowledged version, byte-exact; a removed key not put again
        is a miss; a control (on A's disk tier) is a hit."""
        keys = list(self.expected)
        got = self.reader("get_versions", keys=keys, layout=LAYOUT, upto=self.version + 1)
        seen = dict(zip(keys, got["versions"], strict=True))
        wrong = sorted(k for k, v in seen.items() if v != self.expected[k])
        assert not wrong, (f"read {[(k, seen[k]) for k in wrong]}, expected {[(k, self.expected[k]) for k in wrong]} "
                           f"(codes {[c for k, c in zip(keys, got['codes'], strict=True) if k in wrong]})")

    def put(self, store: StoreProcess, keys: list[str], version: int) -> None:
        target = store("id")["id"]
        assert self.reader("put", keys=keys, layout=LAYOUT, version=version, preferred=[target])["codes"] == [0] * len(keys)
        self.expected.update((k, version) for k in keys)

    def restart_a(self) -> None:
        """kill -9 A and start a new A on the same disk_path; wait until it has joined."""
        self.a.kill()
        before = {g["segment_id"] for g in self.ms.http("/get_all_segments")["segments"]}
        self.a = self._provider()
        new = self.a("id")["id"]
        assert new not in before
        wait_for(lambda: any(g["segment_id"] == new for g in self.ms.http("/get_all_segments")["segments"]),
                 15, "the restarted provider to join")

    def round(self, n: int) -> None:
        kind = KINDS[n % len(KINDS)]
        keys = [f"dr-{self.tag}-{n}-{i}" for i in range(REMOVED + CONTROLS)]
        removed = keys[:REMOVED]
        self.version += 2
        self.put(self.a, keys, self.version)
        wait_for(lambda: all("DISK" in m for m in self.reader("key_info", keys=keys)["media"]), 15,
                 "every key to have its disk record")
        self.check()                                   # the reader's gets lease the objects
        if kind in ("remove", "re-put"):
            assert self.reader("remove", keys=removed)["codes"] == [0] * REMOVED
            self.expected.update((k, None) for k in removed)
            if kind == "re-put":
                self.put(self.b, removed, self.version + 1)
            self.restart_a()
        else:
            os.kill(self.a.proc.pid, signal.SIGSTOP)  # it cannot hear of the removal
            out: dict[str, Any] = {}
            remover = threading.Thread(target=lambda: out.update(self.reader("remove", keys=removed)))
            remover.start()
            if kind == "frozen":
                wait_for(lambda: self.ms.metric("removes_total") >= self.removes + REMOVED, 10,
                         "the MetaService to take the keys out of its table")
                self.restart_a()                       # while the remove waits for the old A
            remover.join(30)
            assert not remover.is_alive() and out["codes"] == [0] * REMOVED, out
            self.expected.update((k, None) for k in removed)
            if kind == "dead":
                self.restart_a()
        self.removes = self.ms.metric("removes_total")
        self.check()

    removes = 0.0


def test_a_removed_key_never_comes_back_from_a_restarted_providers_disk_tier(tmp_path):
    with running_meta_service(heartbeat_timeout_ms=4000, lease_ttl_ms=1000) as ms:
        pool = DiskRemovals(ms, str(tmp_path / "d"))
        try:
            pool.removes = ms.metric("removes_total")
            for n in range(2 * len(KINDS)):
                pool.round(n)
            wait_for(lambda: len(ms.http("/get_all_segments")["segments"]) == 2, 15,
                     "every killed provider to be declared dead")
            pool.check()
        finally:
            pool.close()
