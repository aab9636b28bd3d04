"""The disk tier under every provider (docs/design.md, "Disk tier"): real processes, real files.

Sizes are scaled down from 256 MB DRAM / 1 GB disk per provider to 32 MB / 128 MB so the file stays
within CI's time on two cores: the pool holds three times its DRAM. ``MEMCACHE_DISK_TEST_SCALE=8`` runs
the first test at full size (256 MB DRAM and 1 GB disk per provider, 1.5 GiB of objects).
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from typing import Any

import pytest

from memcache_core import protocol as p
from memcache_core.auth import load_secret
from memcache_core.layout import payload_offset
from memcache_core.local import disk_record
from memcache_core.rpc import RpcClient, expect
from memcache_core.testing import (
    MetaServiceProcess,
    free_port,
    running_meta_service,
    scrape_metrics,
    wait_for,
)
from tests.integration.stores import StoreProcess

pytestmark = pytest.mark.integration

LAYOUT = [512 << 10, 256 << 10, 256 << 10]      # 1 MiB objects in three pieces
SCALE = int(os.environ.get("MEMCACHE_DISK_TEST_SCALE", "1"))
# heartbeat_timeout_ms at its default: a provider paused by a loaded machine is not declared dead
MS_CONFIG: dict[str, Any] = {"lease_ttl_ms": 1000, "evict_check_interval_seconds": 0.5}


def provider(ms: MetaServiceProcess, disk: str, scale: int = 1, **cfg: Any) -> StoreProcess:
    return StoreProcess(ms, dram_size=f"{32 * scale}MB", disk_path=disk, disk_size=f"{128 * scale}MB", **cfg)


def metric(ms: MetaServiceProcess, name: str) -> float:
    for line in ms.http("/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def disk_event(ms: MetaServiceProcess, event: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in ms.http("/metrics").splitlines()
               if line.startswith("memcache_disk_events_total{") and f'event="{event}"' in line)


def on_disk_at_least(prov: StoreProcess, n: int) -> bool:
    return bool(prov("disk_counters")["counters"]["objects"] >= n)


def flip_dram_byte(ms: MetaServiceProcess, key: str) -> None:
    """Change one payload byte of the key's first DRAM copy, in its segment file."""
    client = RpcClient(ms.meta_service_url, 5.0, 0, load_secret(""))
    try:
        f = expect(client.call(p.Lookup([key], lease=False), idempotent=True), p.LookupReply).results[0]
        assert f is not None and f.locations
        seg = expect(client.call(p.GetSegments([f.locations[0].segment_id]), idempotent=True), p.Segments)
    finally:
        client.close()
    with open(seg.segments[0].shm_path, "r+b") as fh:
        fh.seek(payload_offset(f.locations[0].offset) + 10)
        b = fh.read(1)
        fh.seek(payload_offset(f.locations[0].offset) + 10)
        fh.write(bytes([b[0] ^ 0xFF]))


def read_all(reader: StoreProcess, keys: list[str]) -> list[int]:
    codes: list[int] = []
    for i in range(0, len(keys), 8):
        got = reader("get", keys=keys[i:i + 8], layout=LAYOUT)
        assert not got["mismatches"], f"wrong bytes for {got['mismatches']}"
        codes += got["codes"]
    return codes


def test_pool_holds_three_times_its_dram_and_survives_a_full_restart(tmp_path):
    """Two providers (32 MB DRAM, 128 MB disk each) write 192 MiB together, no faster than their disk
    writers copy (puts never wait for the disk, so a writer faster than its disk loses what eviction
    reaches first: design.md, Disk tier); a third process reads every object byte-exact, most from
    disk. Then every process stops (one provider is SIGKILLed) and starts again on the same disk
    paths: every object is found and read byte-exact again, from disk."""
    disks = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    n = 96 * SCALE
    with running_meta_service(**MS_CONFIG) as ms:
        writers = [provider(ms, d, SCALE) for d in disks]
        keys = [[f"w{w}-{i}" for i in range(n)] for w in range(2)]
        for i in range(0, n, 8):
            for w, wr in enumerate(writers):
                assert wr("put", keys=keys[w][i:i + 8], layout=LAYOUT)["codes"] == [0] * 8
            for wr in writers:   # all but the newest half of DRAM on disk before eviction can reach them
                wait_for(partial(on_disk_at_least, wr, i + 8 - 16 * SCALE), 60, "the disk writer to keep up")
        every = keys[0] + keys[1]
        reader = StoreProcess(ms, init_bm=False)
        assert reader("exist", keys=every)["codes"] == [1] * len(every)
        assert read_all(reader, every) == [0] * len(every)
        assert metric(ms, "memcache_disk_hits_total") >= len(every) / 2, "most objects are read from disk"
        assert metric(ms, "memcache_evictions_to_disk_total") >= len(every) / 2
        wait_for(lambda: disk_event(ms, "writes") >= len(every) / 2, 10, "disk writes reported")
        reader.stop()
        writers[0].kill()
        writers[1].stop()
        ms.stop()
        ms.start()
        writers = [provider(ms, d, SCALE) for d in disks]
        reader = StoreProcess(ms, init_bm=False)
        on_disk = [k for k, c in zip(every, reader("exist", keys=every)["codes"], strict=True) if c == 1]
        assert len(on_disk) >= len(every) / 2, "the objects on disk are found again"
        assert read_all(reader, on_disk) == [0] * len(on_disk)
        assert metric(ms, "memcache_disk_hits_total") >= len(on_disk)
        for p in (reader, *writers):
            p.stop()


def test_a_flipped_byte_in_a_record_is_a_miss_and_counted(tmp_path):
    """A record whose payload was changed on disk is never returned: the read is a miss (-3110), the
    provider counts it and deletes the record, and the object leaves the pool."""
    with running_meta_service(**MS_CONFIG) as ms:
        port = free_port()
        prov = provider(ms, str(tmp_path / "d"), disk_write_policy="write_through", metrics_port=port)
        keys = [f"flip-{i}" for i in range(4)]
        assert prov("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 4
        wait_for(lambda: prov("evict", keys=keys)["codes"] == [0] * 4, 10, "objects on disk only")
        assert prov("key_info", keys=keys)["media"] == [["DISK"]] * 4
        path = os.path.join(tmp_path / "d", "objects", disk_record.name_of(keys[1]))
        with open(path, "r+b") as f:
            f.seek(disk_record.BLOCK + 1000)
            b = f.read(1)
            f.seek(disk_record.BLOCK + 1000)
            f.write(bytes([b[0] ^ 0x01]))
        reader = StoreProcess(ms, init_bm=False)
        got = reader("get", keys=keys, layout=LAYOUT)
        assert got["codes"] == [0, -3110, 0, 0] and not got["mismatches"]
        assert prov("disk_counters")["counters"]["integrity_failures"] == 1
        assert not os.path.exists(path)
        wait_for(lambda: reader("exist", keys=[keys[1]])["codes"] == [0], 10, "the object to leave the pool")
        wait_for(lambda: disk_event(ms, "integrity_failures") == 1, 10, "the failure in /metrics")
        local = scrape_metrics(port, ms.admin_headers())   # the provider's own metrics port
        assert local['memcache_local_disk_events_total{event="integrity_failures"}'] == 1
        assert local["memcache_local_disk_objects"] == 3
        reader.stop()
        prov.stop()


def test_a_full_disk_and_an_io_error_are_counted_never_fatal(tmp_path):
    """A provider whose files may not grow past 64 KiB (RLIMIT_FSIZE: the disk is full for every
    record) keeps taking puts; failed writes are counted and the objects stay DRAM-only. A record
    that cannot be read (an I/O error) is a miss with -3111, never a crash."""
    with running_meta_service(**MS_CONFIG) as ms:
        full = provider(ms, str(tmp_path / "full"), disk_write_policy="write_through", file_size_limit=64 << 10)
        keys = [f"full-{i}" for i in range(8)]
        assert full("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 8
        wait_for(lambda: full("disk_counters")["counters"]["write_errors"] >= 8, 10, "failed writes counted")
        assert full("evict", keys=keys)["codes"] == [-3101] * 8      # no disk copy: they stay in DRAM
        assert full("get", keys=keys, layout=LAYOUT)["codes"] == [0] * 8
        full.stop()
        prov = provider(ms, str(tmp_path / "d"), disk_write_policy="write_through")
        keys = [f"eio-{i}" for i in range(2)]
        assert prov("put", keys=keys, layout=LAYOUT)["codes"] == [0, 0]
        wait_for(lambda: prov("evict", keys=keys)["codes"] == [0, 0], 10, "objects on disk only")
        path = os.path.join(tmp_path / "d", "objects", disk_record.name_of(keys[0]))
        os.unlink(path)
        os.mkdir(path)          # reading it fails with EISDIR: an I/O error
        reader = StoreProcess(ms, init_bm=False)
        assert reader("get", keys=keys, layout=LAYOUT)["codes"] == [-3111, 0]
        assert prov("disk_counters")["counters"]["read_errors"] == 1
        assert prov("get", keys=keys[1:], layout=LAYOUT)["codes"] == [0]
        reader.stop()
        prov.stop()


def test_puts_never_wait_for_a_slow_disk(tmp_path):
    """A provider whose disk writer may write only 4 MB/s (write_through) takes 48 MiB of puts at
    memory speed: the puts are done long before the writer is, and none of them waits on it."""
    with running_meta_service(**MS_CONFIG) as ms:
        prov = StoreProcess(ms, dram_size="96MB", disk_path=str(tmp_path / "d"), disk_size="128MB",
                            disk_write_policy="write_through", disk_write_limit="4MB")
        slowest = 0.0
        for i in range(6):
            got = prov("put", keys=[f"slow-{i}-{j}" for j in range(8)], layout=LAYOUT)
            assert got["codes"] == [0] * 8
            slowest = max(slowest, got["seconds"])
        # The writer needs 12 s for the 48 MiB: it is still behind when the last put returned, whatever
        # the load, unless the puts waited for it; one put waiting for its own 8 MiB would take 2 s.
        written = prov("disk_counters")["counters"]["write_bytes"]
        assert written < 6 * 8 * sum(LAYOUT), "the puts waited for the disk writer"
        assert slowest < 2.0, f"a put took {slowest:.2f}s"
        prov.stop()


def test_prefetch_and_promotion_bring_disk_objects_back_into_dram(tmp_path):
    """evict(keys) leaves objects on disk only; prefetch(keys) brings them back into DRAM; a
    disk-only object read twice is promoted by its provider on its own."""
    with running_meta_service(**MS_CONFIG) as ms:
        prov = provider(ms, str(tmp_path / "d"), disk_write_policy="write_through")
        keys = [f"pf-{i}" for i in range(4)]
        assert prov("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 4
        wait_for(lambda: prov("evict", keys=keys)["codes"] == [0] * 4, 10, "objects on disk only")
        reader = StoreProcess(ms, init_bm=False)
        wait_for(lambda: reader("pool_has_disk_tier")["value"], 10, "the pool's disk tier told by a heartbeat")
        assert reader("prefetch", keys=keys[:2] + ["absent"])["codes"] == [0, 0, -3007]
        assert reader("key_info", keys=keys[:2])["media"] == [["DRAM", "DISK"]] * 2
        for _ in range(2):
            assert reader("get", keys=keys[2:], layout=LAYOUT)["codes"] == [0, 0]
        wait_for(lambda: reader("key_info", keys=keys[2:])["media"] == [["DRAM", "DISK"]] * 2, 10,
                 "promotion after two disk reads")
        assert metric(ms, "memcache_promotions_total") == 4
        status = subprocess.run([sys.executable, "-m", "memcache_core.cli", "status", "--url", ms.metrics_url],
                                capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "220"})
        assert status.returncode == 0 and any(" disk " in line for line in status.stdout.splitlines()), status.stdout
        got = reader("get", keys=keys, layout=LAYOUT)
        assert got["codes"] == [0] * 4 and not got["mismatches"]
        reader.stop()
        prov.stop()


def test_disk_objects_survive_a_metaservice_restart(tmp_path):
    """The MetaService is killed and restarted while the provider lives: the provider re-joins with its
    disk records and the disk-only objects are read byte-exact again."""
    with running_meta_service(**MS_CONFIG) as ms:
        prov = provider(ms, str(tmp_path / "d"), disk_write_policy="write_through")
        keys = [f"ms-{i}" for i in range(6)]
        assert prov("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 6
        wait_for(lambda: prov("evict", keys=keys[:4])["codes"] == [0] * 4, 10, "objects on disk only")
        ms.kill()
        ms.start()
        reader = StoreProcess(ms, init_bm=False)
        wait_for(lambda: reader("exist", keys=keys)["codes"] == [1] * 6, 15, "the provider's re-join")
        got = reader("get", keys=keys, layout=LAYOUT)
        assert got["codes"] == [0] * 6 and not got["mismatches"]
        # every record is known again (a DRAM copy whose eviction had not reached the provider's
        # journal before the kill may come back too: its bytes are verified all the same)
        assert all("DISK" in m for m in reader("key_info", keys=keys)["media"])
        reader.stop()
        prov.stop()


def test_a_provider_killed_and_restarted_at_once_keeps_its_disk_objects(tmp_path):
    """A provider is SIGKILLed and started again on its disk_path before the MetaService declares the
    old one dead: the new one's records take over, and the old one's death loses nothing."""
    with running_meta_service(**MS_CONFIG, heartbeat_timeout_ms=3000) as ms:   # the old one's death
        prov = provider(ms, str(tmp_path / "d"), disk_write_policy="write_through")
        keys = [f"kr-{i}" for i in range(4)]
        assert prov("put", keys=keys, layout=LAYOUT)["codes"] == [0] * 4
        wait_for(lambda: prov("evict", keys=keys)["codes"] == [0] * 4, 10, "objects on disk only")
        prov.kill()
        prov = provider(ms, str(tmp_path / "d"))
        wait_for(lambda: metric(ms, 'memcache_member_events_total{event="deaths"}') == 1, 15, "the old one dead")
        reader = StoreProcess(ms, init_bm=False)
        got = reader("get", keys=keys, layout=LAYOUT)
        assert got["codes"] == [0] * 4 and not got["mismatches"]
        reader.stop()
        prov.stop()


def test_a_corrupt_dram_copy_is_read_from_the_disk_record(tmp_path):
    """Every DRAM copy of an object fails its checksum: the read moves on to the provider's disk record
    (byte-exact), and the bad DRAM copy is dropped while the object stays, on disk."""
    with running_meta_service(**MS_CONFIG) as ms:
        prov = provider(ms, str(tmp_path / "d"), disk_write_policy="write_through")
        assert prov("put", keys=["fb"], layout=LAYOUT)["codes"] == [0]
        wait_for(lambda: prov("key_info", keys=["fb"])["media"] == [["DRAM", "DISK"]], 10, "the disk record")
        flip_dram_byte(ms, "fb")
        reader = StoreProcess(ms, init_bm=False)
        got = reader("get", keys=["fb"], layout=LAYOUT)
        assert got["codes"] == [0] and not got["mismatches"]
        wait_for(lambda: reader("key_info", keys=["fb"])["media"] == [["DISK"]], 10, "the bad copy dropped")
        assert metric(ms, "memcache_integrity_failures_total") == 1
        reader.stop()
        prov.stop()


def test_one_disk_path_serves_one_provider(tmp_path):
    """A second provider on a disk_path in use is refused at init with -3000 (a lock file)."""
    with running_meta_service(**MS_CONFIG) as ms:
        first = provider(ms, str(tmp_path / "d"))
        with pytest.raises(RuntimeError, match="-3000"):
            provider(ms, str(tmp_path / "d"))
        first.stop()
