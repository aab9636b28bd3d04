"""Fresh segments faulted in the background (local/prefault.py): start never waits for it, puts that
land meanwhile are byte-exact, and afterwards every page of the segment is mapped."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from memcache_core import DistributedObjectStore, LocalConfig
from memcache_core.errors import ConfigError
from memcache_core.local.prefault import thp_shmem_mode
from memcache_core.testing import MetaServiceProcess, start_local_service, wait_for

MIB = 1 << 20


def mapped_kib(pid: int, name_part: str) -> int:
    """Rss of the mappings of ``pid`` whose file name contains ``name_part`` (from /proc/<pid>/smaps)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = name_part in line
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_prefault_runs_beside_start_and_puts(meta: MetaServiceProcess) -> None:
    size = 512 * MIB
    store = DistributedObjectStore()
    assert store.setup(meta.local_config(dram_size=size, segment_prefault="on")) == 0
    assert store.init(0, init_bm=True) == 0
    started = time.monotonic()
    svc = store._service()
    pf, seg = svc.prefault, svc.segment
    assert pf is not None and seg is not None
    try:
        payloads = {f"early/{i}": os.urandom(3 * MIB + 4097 * i) for i in range(8)}
        assert [store.put(k, v) for k, v in payloads.items()] == [0] * 8
        wait_for(pf.done.is_set, 120, "the background pre-fault")
        assert started < pf.finished_at, "start waited for the pre-fault"
        assert mapped_kib(os.getpid(), os.path.basename(seg.path)) >= size // 1024
        for key, value in payloads.items():
            assert store.get(key) == value
        late = os.urandom(5 * MIB)
        assert store.put("late", late) == 0 and store.get("late") == late
    finally:
        store.close()


def test_close_stops_the_prefault_before_unmapping(meta: MetaServiceProcess) -> None:
    store = DistributedObjectStore()
    assert store.setup(meta.local_config(dram_size="1GB", segment_prefault="on")) == 0
    assert store.init(0, init_bm=True) == 0
    pf = store._service().prefault
    assert pf is not None
    assert store.close() == 0
    assert pf.done.is_set()     # stopped (or finished) before the segment was unmapped


def test_embedded_segments_are_not_prefaulted_by_default(meta: MetaServiceProcess) -> None:
    store = DistributedObjectStore()
    assert store.setup(meta.local_config()) == 0 and store.init(0, init_bm=True) == 0
    try:
        assert store._service().prefault is None
    finally:
        store.close()


def test_standalone_provider_prefaults_its_segment(meta: MetaServiceProcess, tmp_path: Path) -> None:
    provider, _ = start_local_service({"meta_service_url": meta.meta_service_url, "protocol": "host_shm",
                                       "dram_size": "128MB", "heartbeat_interval_ms": 200}, tmp_path,
                                      lambda: meta.http("/get_all_segments")["segments"])
    try:
        wait_for(lambda: mapped_kib(provider.pid, f"memcache-{provider.pid}-") >= 128 * 1024, 60,
                 "every page of the provider's segment mapped")
    finally:
        provider.terminate()
        assert provider.wait(10) == 0


def test_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match="segment_prefault"):
        LocalConfig(segment_prefault="sometimes")   # type: ignore[arg-type]   # not one of the choices, on purpose
    for bad in (-1, 65, 1.5):
        with pytest.raises(ConfigError, match="shm_copy_threads"):
            LocalConfig(shm_copy_threads=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="segment_hugepages"):
        LocalConfig(segment_hugepages="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("text,mode", [("always within_size advise [never] deny force\n", "never"),
                                       ("always [advise] never\n", "advise"), ("", "")])
def test_thp_shmem_mode(tmp_path: Path, text: str, mode: str) -> None:
    f = tmp_path / "shmem_enabled"
    f.write_text(text)
    assert thp_shmem_mode(str(f)) == mode
    assert thp_shmem_mode(str(tmp_path / "absent")) == ""
