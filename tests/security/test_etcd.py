"""etcd as an attack path (issue 23): a real etcd with its auth on, and the leader key deleted and
rewritten under traffic. Three HA MetaServices and two LocalServices doing verified puts and gets
(``tests.integration.test_ha``'s pool)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from memcache_core.errors import ConfigError
from memcache_core.etcd import Etcd, EtcdAuth, EtcdRefused, leader_key
from memcache_core.testing import MetaServiceProcess, wait_for
from memcache_core.testing_etcd import EtcdProcess, etcd_binary, make_etcd_tls_files
from tests.integration.stores import StoreProcess
from tests.integration.test_ha import LAYOUT, TTL_S, Pool, Traffic, pool, start_traffic, verify_all  # noqa: F401

pytestmark = pytest.mark.integration


class RoleWatch(threading.Thread):
    """Polls every MetaService's /role in turn; records an overlap when one MetaService answered
    "leader" (same term) on two polls in a row and another answered "leader" in between."""

    def __init__(self, metas: list[MetaServiceProcess]) -> None:
        super().__init__(daemon=True)
        self.metas = metas
        self.samples: list[tuple[int, int]] = []   # (which MetaService, term) of each "leader" answer, in order
        self.polls = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            for i, m in enumerate(self.metas):
                try:
                    role = m.http("/leader")
                except OSError:
                    continue
                self.polls += 1
                self.samples.append((i, role["term"]) if role["role"] == "leader" else (i, 0))

    def overlaps(self) -> list[tuple[int, int]]:
        last: dict[int, tuple[int, int]] = {}   # MetaService -> (its last term, index of that sample)
        found = []
        for n, (i, term) in enumerate(self.samples):
            prev = last.get(i)
            if term and prev is not None and prev[0] == term:
                others = {j for j, t in self.samples[prev[1] + 1:n] if t and j != i}
                found += [(i, j) for j in others]
            last[i] = (term, n)
        return found


def test_deleting_and_rewriting_the_leader_key_under_traffic_never_makes_two_leaders(pool):  # noqa: F811
    """Scenario: someone who can write etcd deletes the leader key, then rewrites it to point at
    another address, then deletes it again, while two members put and get. Before, the old leader
    only refreshed its lease: after the delete a standby won and both answered for good. Now the
    leader reads its key at every renewal and steps down the moment it is not the owner, and a winner
    whose predecessor's lease is alive waits out its serving window: /role never shows two leaders,
    and every acknowledged put is readable, byte-exact, at the end."""
    old = pool.leader()
    a, b, traffic = start_traffic(pool)
    watch = RoleWatch(pool.metas)
    watch.start()
    etcd = Etcd((("127.0.0.1", pool.etcd.port),), 2.0)
    key = leader_key(pool.cluster)
    try:
        old_term = old.http("/leader")["term"]
        etcd.call(lambda c: c.delete(key))
        t_deleted = time.monotonic()
        wait_for(lambda: any(m.http("/leader")["term"] > old_term for m in pool.leaders()), 5 * TTL_S,
                 "a leader of a new term after the delete")
        assert old.http("/leader")["role"] == "standby" or old.http("/leader")["term"] > old_term
        wait_for(lambda: all(t.resumed_since(t_deleted) for t in traffic), 20, "both clients to put again")
        etcd.call(lambda c: c.put(key, json.dumps({"control": "tcp://127.0.0.1:1", "config_store": "tcp://127.0.0.1:1",
                                                   "admin": "http://127.0.0.1:1"})))
        wait_for(lambda: not pool.leaders(), 2 * TTL_S, "the leader to step down once its key was rewritten")
        etcd.call(lambda c: c.delete(key))
        t_back = time.monotonic()
        pool.leader(5 * TTL_S)
        wait_for(lambda: all(t.resumed_since(t_back) for t in traffic), 20, "both clients to put again")
    finally:
        watch.halt.set()
        watch.join(10)
    for t in traffic:
        t.stop()
    verify_all([a, b], traffic, pool)
    assert watch.polls > 50
    assert not watch.overlaps(), f"two MetaServices answered as leader at once: {watch.overlaps()[:5]}"


# ---- etcd with its authentication on ---------------------------------------------------------------

@pytest.fixture
def secured_etcd() -> Iterator[tuple[EtcdProcess, str]]:
    """A real etcd with auth enabled: user ``memcache`` may read and write ``/memcache/`` only; the
    second item is a file (0600) with its password."""
    with tempfile.TemporaryDirectory(prefix="memcache-etcd-") as d:
        etcd = EtcdProcess(d).start()
        try:
            ctl = [os.path.join(os.path.dirname(etcd_binary()), "etcdctl"), "--endpoints", etcd.endpoint]
            for args in (["user", "add", "root:root-pw-" + os.urandom(8).hex()],
                         ["user", "add", "memcache:mc-pw-for-this-test"], ["role", "add", "memcache"],
                         ["role", "grant-permission", "memcache", "--prefix=true", "readwrite", "/memcache/"],
                         ["user", "grant-role", "memcache", "memcache"], ["auth", "enable"]):
                subprocess.run(ctl + args, check=True, capture_output=True, timeout=30)
            password = os.path.join(d, "etcd.password")
            fd = os.open(password, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("mc-pw-for-this-test\n")
            yield etcd, password
        finally:
            etcd.stop()


def test_ha_works_against_an_etcd_with_auth_and_nothing_gets_in_without_credentials(secured_etcd, tmp_path):
    """Scenario: etcd has its auth on. A MetaService with ``ha_etcd_user``/``ha_etcd_password_path``
    leads and a member following ``etcd://`` with the same keys puts and gets; a client without
    credentials can neither read nor rewrite the leader key, and a MetaService without them never
    leads (it says etcd is unreachable). A password file others can read is refused at start."""
    etcd, password = secured_etcd
    creds = {"ha_etcd_user": "memcache", "ha_etcd_password_path": password}
    ha = {"ha_enable": True, "ha_etcd_endpoints": etcd.endpoint, "ha_cluster_id": "secure", "ha_lease_ttl_ms": 2000}
    meta = MetaServiceProcess(str(tmp_path), **ha, **creds)
    bare = MetaServiceProcess(str(tmp_path), **ha)
    store = None
    try:
        meta.start()
        bare.start()
        wait_for(lambda: meta.http("/leader")["role"] == "leader", 10, "the MetaService with credentials to lead")
        store = StoreProcess(meta, meta_service_url=f"etcd://127.0.0.1:{etcd.port}/secure", dram_size="64MB",
                             client_timeout_seconds=2, **creds)
        assert store("put", keys=["secure-0"], layout=LAYOUT)["codes"] == [0]
        got = store("get", keys=["secure-0"], layout=LAYOUT)
        assert got["codes"] == [0] and got["mismatches"] == []
        anonymous = Etcd((("127.0.0.1", etcd.port),), 2.0)
        for attempt in (lambda c: c.get(leader_key("secure")), lambda c: c.delete(leader_key("secure")),
                        lambda c: c.put(leader_key("secure"), "{}")):
            with pytest.raises(EtcdRefused):
                anonymous.call(attempt)
        assert meta.http("/leader")["role"] == "leader"
        role = bare.http("/leader")
        assert role["role"] == "standby" and role["etcd_reachable"] is False
        assert "refused" in bare.log_tail()
        wrong = tmp_path / "wrong.password"
        wrong.write_text("mc-pw-for-this-test\n")
        wrong.chmod(0o644)
        with pytest.raises(ConfigError, match="ha_etcd_password_path"):
            Etcd((("127.0.0.1", etcd.port),), 2.0, EtcdAuth(user="memcache", password_path=str(wrong))).call(
                lambda c: c.get("/memcache/x"))
    finally:
        if store is not None:
            store.stop()
        bare.stop()
        meta.stop()


def test_ha_works_against_an_etcd_that_requires_tls_client_certificates(tmp_path):
    """Scenario: etcd speaks https only and requires a client certificate signed by its CA. A
    MetaService with ``ha_etcd_ca_path`` and ``ha_etcd_cert_path``/``ha_etcd_key_path`` leads, and a
    member following ``etcd://`` with the same keys puts and gets; a client without a certificate
    cannot reach the leader key."""
    files = make_etcd_tls_files(str(tmp_path))
    etcd = EtcdProcess(str(tmp_path), tls=files).start()
    creds = {"ha_etcd_ca_path": files["ca"], "ha_etcd_cert_path": files["client_cert"],
             "ha_etcd_key_path": files["client_key"]}
    meta = MetaServiceProcess(str(tmp_path), ha_enable=True, ha_etcd_endpoints=etcd.endpoint, ha_cluster_id="tls",
                              ha_lease_ttl_ms=2000, **creds)
    store = None
    try:
        meta.start()
        wait_for(lambda: meta.http("/leader")["role"] == "leader", 10,
                 lambda: f"the MetaService to lead over https: {meta.log_tail()}")
        store = StoreProcess(meta, meta_service_url=f"etcd://127.0.0.1:{etcd.port}/tls", dram_size="64MB",
                             client_timeout_seconds=2, **creds)
        assert store("put", keys=["tls-0"], layout=LAYOUT)["codes"] == [0]
        got = store("get", keys=["tls-0"], layout=LAYOUT)
        assert got["codes"] == [0] and got["mismatches"] == []
        no_cert = Etcd((("127.0.0.1", etcd.port),), 2.0, EtcdAuth(ca_path=files["ca"]))
        with pytest.raises(Exception, match="(?i)ssl|certificate|unreachable|refused"):
            no_cert.call(lambda c: c.get(leader_key("tls")))
    finally:
        if store is not None:
            store.stop()
        meta.stop()
        etcd.stop()
