"""A same-host provider killed under a stream of shared-memory puts: no put it could not keep is
acknowledged. The writer copies into the provider's file (which outlives the process); before the fix
it committed and returned 0 for puts into a provider dead for seconds, and those objects vanished when
the MetaService declared it dead (``heartbeat_timeout_ms`` later)."""

from __future__ import annotations

import functools
import time

import pytest

from memcache_core import DistributedObjectStore
from memcache_core import protocol as p
from memcache_core.testing import wait_for
from tests.integration.stores import HEARTBEAT_TIMEOUT_MS
from tests.integration.test_drain import segments_of

pytestmark = pytest.mark.integration

LAYOUT = [16 << 10]
BATCH = 8
PUTTING_AFTER_KILL_S = 3.0   # well under the heartbeat timeout: the MetaService has not declared it dead
PACE_S = 0.05                # one batch per pace at most: 3 rounds stay far below eviction's high-water mark


def segment_ids(meta) -> set[int]:
    return {s["segment_id"] for s in meta.http("/get_all_segments")["segments"]}


def joined_since(meta, before: set[int]) -> set[int]:
    return segment_ids(meta) - before


def left(meta, sid: int) -> bool:
    return sid not in segment_ids(meta)


def test_puts_acknowledged_after_a_same_host_provider_died_stay_readable(meta, stores):
    """Scenario: a pure client puts (host_shm, spread over two providers of its host) in a loop; one
    provider is killed with kill -9 mid-stream and the client keeps putting for 3 s, within the default
    heartbeat timeout. Every put that returned 0 after the kill is read back byte-exact by another
    process, also once the dead provider has left the pool. Keys the dead provider held are misses
    or its committed bytes, never an error or a hang. Three rounds, a new provider each; the last one
    first puts again the keys the dead provider holds (a no-op for a stored key, but these go with it)."""
    assert HEARTBEAT_TIMEOUT_MS >= 10_000   # the default: the kill is not noticed through heartbeats
    stores()                      # the provider that lives
    writer = stores(init_bm=False)
    reader = stores(init_bm=False)
    acked_after: list[str] = []
    for rnd in range(3):
        before = segment_ids(meta)
        victim = stores()
        (victim_sid,) = wait_for(functools.partial(joined_since, meta, before), 10, "the new provider to join")
        seq = iter(range(1 << 30))
        held: list[str] = []          # acknowledged before the kill, placed in the victim
        while len(held) < BATCH:      # until the victim holds a batch's worth (placement is spread)
            keys = [f"r{rnd}-before-{next(seq)}" for _ in range(BATCH)]
            assert writer("put", keys=keys, layout=LAYOUT)["codes"] == [0] * BATCH
            where = segments_of(meta, keys)
            held += [k for k in keys if where[k] == [victim_sid]]
        victim.kill()                 # kill -9, and reaped: every put below starts after the death
        end = time.monotonic() + PUTTING_AFTER_KILL_S
        acked: list[str] = []
        failed: dict[int, int] = {}
        # the last round first puts again the keys the victim holds: a put of a stored key is a no-op,
        # but these are stored only with the dead
        again = held if rnd == 2 else []
        while time.monotonic() < end:
            time.sleep(PACE_S)
            keys, again = again or [f"r{rnd}-after-{next(seq)}" for _ in range(BATCH)], []
            for k, code in zip(keys, writer("put", keys=keys, layout=LAYOUT)["codes"], strict=True):
                if code == 0:
                    acked.append(k)
                else:
                    failed[code] = failed.get(code, 0) + 1
        noticed = victim_sid not in segment_ids(meta)   # before the heartbeat timeout
        assert acked, f"round {rnd}: no put succeeded after the kill (failures by code: {failed})"
        assert set(failed) <= {-3018}, f"round {rnd}: failed puts by code: {failed}"
        got = reader("get", keys=acked, layout=LAYOUT)
        assert got["mismatches"] == [] and got["codes"] == [0] * len(acked), (rnd, got["codes"])
        dead = reader("get", keys=held, layout=LAYOUT)   # the dead provider's objects (or put again)
        assert dead["mismatches"] == [] and set(dead["codes"]) <= {0, -3007}, (rnd, dead["codes"])
        wait_for(functools.partial(left, meta, victim_sid), HEARTBEAT_TIMEOUT_MS / 1000 + 20,
                 "the killed provider to leave the pool")
        acked_after += acked
        got = reader("get", keys=acked_after, layout=LAYOUT)
        lost = [k for k, c in zip(acked_after, got["codes"], strict=True) if c != 0]
        assert got["mismatches"] == [] and not lost, \
            f"round {rnd}: {len(lost)} of {len(acked_after)} puts acknowledged after a kill were lost: {lost[:5]}"
        if rnd != 2:
            assert reader("get", keys=held, layout=LAYOUT)["codes"] == [-3007] * len(held)
        assert noticed, f"round {rnd}: the killed provider was still in the pool {PUTTING_AFTER_KILL_S} s after its death"
    # readable until removed: a remove takes them, and they are misses then
    assert reader("remove", keys=acked_after)["codes"] == [0] * len(acked_after)
    assert set(reader("get", keys=acked_after, layout=LAYOUT)["codes"]) == {-3007}



@pytest.mark.parametrize("writer_kind", ["client", "provider"])
def test_a_put_of_keys_stored_only_with_a_dead_provider_stores_them_again(meta, stores, writer_kind):
    """Scenario: keys are stored in provider V only; V is killed with kill -9, and a writer of its host
    puts the same keys again within the heartbeat timeout: a pure client (the two-phase put), or a
    provider (small puts go through its arena first). A put of a stored key is a no-op returning 0, but
    these are stored only with the dead: every put that returns 0 has stored them again, and another
    process reads them back byte-exact once V has left the pool."""
    stores()                      # a provider that lives
    before = segment_ids(meta)
    victim = stores()
    (victim_sid,) = wait_for(functools.partial(joined_since, meta, before), 10, "the new provider to join")
    writer = stores(init_bm=False) if writer_kind == "client" else stores()
    reader = stores(init_bm=False)
    keys = [f"held-{i}" for i in range(BATCH)]
    assert reader("put", keys=keys, layout=LAYOUT, preferred=[victim_sid])["codes"] == [0] * BATCH
    assert all(where == [victim_sid] for where in segments_of(meta, keys).values())
    victim.kill()
    codes = writer("put", keys=keys, layout=LAYOUT)["codes"]
    assert set(codes) <= {0, -3018}, codes
    stored = [k for k, c in zip(keys, codes, strict=True) if c == 0]
    assert stored, codes
    wait_for(functools.partial(left, meta, victim_sid), HEARTBEAT_TIMEOUT_MS / 1000 + 20,
             "the killed provider to leave the pool")
    got = reader("get", keys=stored, layout=LAYOUT)
    assert got["mismatches"] == [] and got["codes"] == [0] * len(stored), got["codes"]


def test_gva_writes_finished_after_a_same_host_provider_died_stay_readable(meta, stores):
    """Scenario: the GVA path (vllm-ascend's layer-wise save: batch_alloc, batch_copy per layer,
    batch_write_finish) of a pure client after one of two providers of its host was killed with kill -9,
    within the heartbeat timeout. Objects placed with the dead provider are copied into its file and
    committed, but their finish fails (-3018); every finish that returns 0 is read back byte-exact by
    another process once the dead provider has left the pool."""
    stores()
    before = segment_ids(meta)
    victim = stores()
    (victim_sid,) = wait_for(functools.partial(joined_since, meta, before), 10, "the new provider to join")
    writer = stores(init_bm=False)
    reader = stores(init_bm=False)
    victim.kill()
    keys = [f"gva-{i}" for i in range(4 * BATCH)]
    saved = writer("gva_save", keys=keys, layout=[4096] * 4)
    assert saved["alloc"] == [0] * len(keys)
    finished = [k for k, c in zip(keys, saved["finish"], strict=True) if c == 0]
    assert set(saved["finish"]) <= {0, -3018} and finished, saved["finish"]
    wait_for(functools.partial(left, meta, victim_sid), HEARTBEAT_TIMEOUT_MS / 1000 + 20,
             "the killed provider to leave the pool")
    got = reader("get", keys=finished, layout=[4096 * 4])
    assert got["mismatches"] == [] and got["codes"] == [0] * len(finished), got["codes"]


def test_a_false_report_costs_a_live_provider_a_rejoin(meta, stores):
    """Scenario: a member of the host reports a live provider dead (``OwnerGone`` naming its segment and
    file: a lie, or a mistake). The MetaService drops it; its next heartbeat is answered "unknown", it
    re-joins with the same segment id and reports its objects, and every one is read back byte-exact."""
    provider = stores()
    (sid,) = segment_ids(meta)
    keys = [f"kept-{i}" for i in range(BATCH)]
    assert provider("put", keys=keys, layout=LAYOUT)["codes"] == [0] * BATCH
    reporter = DistributedObjectStore()
    assert reporter.setup(meta.local_config()) == 0 and reporter.init(0, False) == 0
    try:
        svc = reporter._service()
        seg, s = svc.segment_info(sid), svc.session
        assert isinstance(svc.rpc.call(p.OwnerGone(s.client_id, s.token, sid, seg.shm_path)), p.Ok)
        wait_for(lambda: provider("exist", keys=keys)["codes"] == [1] * BATCH, 20,
                 "the provider to re-join and report its objects")
        assert segment_ids(meta) == {sid}
        got = provider("get", keys=keys, layout=LAYOUT)
        assert got["mismatches"] == [] and got["codes"] == [0] * BATCH
        assert 'memcache_member_events_total{event="deaths"} 1.0' in meta.http("/metrics")   # it was dropped
    finally:
        reporter.close()
