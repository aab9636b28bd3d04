"""A provider killed (kill -9) and started again on its ``disk_path`` and its ``hcom_url`` brings its
disk-tier objects back for every reader, while its old incarnation is still a member and after that
one is declared dead (docs/design.md, "Disk tier": warm restart; "Failure of a LocalService").

The order is forced: each restart's new incarnation joins (reporting the records) long before the
old one can be declared dead (``heartbeat_timeout_ms`` is far beyond a restart), and the reader,
which read the objects from the old incarnation over its data server a moment before, reads them
from the new one at once, on the same address. Then every old incarnation is declared dead and the
objects are read again.
"""

from __future__ import annotations

import functools

import pytest

from memcache_core.testing import MetaServiceProcess, free_port, running_meta_service, wait_for
from tests.integration.stores import StoreProcess

pytestmark = pytest.mark.integration

LAYOUT = [32 << 10] * 2
KEYS = [f"restart-{i}" for i in range(6)]
RESTARTS = 3


def _segments(ms: MetaServiceProcess) -> set[int]:
    return {g["segment_id"] for g in ms.http("/get_all_segments")["segments"]}


def _joined(ms: MetaServiceProcess, segment_id: int) -> bool:
    return segment_id in _segments(ms)


def test_a_quickly_restarted_provider_serves_its_disk_records_beside_its_old_incarnation(tmp_path):
    """Scenario: provider A (write_through disk tier, a fixed data-server port) holds KEYS on disk
    only; a reader reads them from A's data server. A is killed and started again on the same
    disk_path and port; the new A joins while the old is still a member. Before, the reader sent its
    read of the new A on the pooled connection to the dead one, and every key read as a miss. Now
    every read is a hit with the bytes put, after each of the restarts and once every old incarnation
    is declared dead."""
    port = free_port()
    with running_meta_service(heartbeat_timeout_ms=10_000, lease_ttl_ms=1000) as ms:
        def provider() -> StoreProcess:
            return StoreProcess(ms, dram_size="32MB", disk_path=str(tmp_path / "d"), disk_size="64MB",
                                disk_write_policy="write_through", hcom_url=f"tcp://127.0.0.1:{port}")

        a = provider()
        reader = StoreProcess(ms, init_bm=False, client_timeout_seconds=20)
        try:
            a_id = a("id")["id"]
            assert reader("put", keys=KEYS, layout=LAYOUT, version=1, preferred=[a_id])["codes"] == [0] * len(KEYS)
            wait_for(lambda: all("DISK" in m for m in reader("key_info", keys=KEYS)["media"]), 15,
                     "every key to have its disk record")

            def read_from_disk(incarnation: int) -> None:
                """Drop the DRAM copies (the reads then go to A's data server) and read every key."""
                assert reader("evict", keys=KEYS)["codes"] == [0] * len(KEYS)
                got = reader("get_versions", keys=KEYS, layout=LAYOUT, upto=1)
                assert got["versions"] == [1] * len(KEYS), (incarnation, got)

            read_from_disk(0)
            for n in range(1, RESTARTS + 1):
                a.kill()
                a = provider()
                new = a("id")["id"]
                wait_for(functools.partial(_joined, ms, new), 15, "the restarted provider to join")
                read_from_disk(n)        # the old incarnation is still a member: heartbeat_timeout_ms
            wait_for(lambda: _segments(ms) == {new}, 30, "every old incarnation to be declared dead")
            read_from_disk(RESTARTS + 1)
            assert {ms.http(f"/query_key?key={k}")["disk"] for k in KEYS} == {new}
        finally:
            reader.stop()
            a.stop()
