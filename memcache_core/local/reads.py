"""Get, as a pipeline read top to bottom in ``Reads.get`` (docs/design.md, "The read path"):

    plan -> early copy -> lookup -> copy/verify -> fallback -> confirm

* **plan**: the valid keys (an invalid key gets its error, the batch goes on);
* **early copy**: objects this client remembers (``hints.py``) are copied while the lookup is on
  the way; a copy counts only where the reply names the object it read (``_settle_early``);
* **lookup**: ``Lookup`` leases the objects for ``lease_ttl`` and names their replicas; buffers that
  do not fit the object are errors;
* **copy/verify**: disk-only objects from the provider holding their record (``tier.py``), the
  others from their replicas nearest first; a replica whose bytes fail their checksum is corrupt and
  the next one is read; a read that has another copy to go to waits on a peer that moves no bytes
  only until its progress deadline (``read_deadline_ms``, ``transfer/tcp.py``'s ``Deadline``);
* **fallback**: where every DRAM copy failed, the provider's disk record is one more replica;
* **confirm**: a get that finished later than 80% of its lease is confirmed with ``Validate`` before
  its reads count; corrupt replicas are reported to the MetaService, which drops them.

Each stage is a function of what the ones before it returned: the objects the lookup found
(``found``, never changed after it) and the keys still to read. A stage returns the outcomes of the
keys it settled (``Outcomes``: key index -> None or the error), and ``get`` alone writes them into the
per-key results; no stage calls back into an earlier one.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING

from .. import errors
from .. import protocol as p
from ..errors import InvalidParameter, MemCacheError, valid_key
from ..memory import Mapping, buffer_address
from ..rpc import expect
from ..transfer import CopyOp
from . import tier
from .hints import LocationHints
from .membership import Membership, in_batches
from .session import Pieces, clip

if TYPE_CHECKING:
    from ..transfer.engine import TransferEngine
    from .metrics import LocalMetrics

logger = logging.getLogger(__name__)

LEASE_SAFETY = 0.8          # trust a read without Validate only if it ended within 80% of the lease

Outcomes = dict[int, MemCacheError | None]   # what a stage settled: key index -> None (read) or the error


class Reads(Membership):
    """``LocalService.get`` and its phases (a mixin)."""

    integrity_failures: int
    _sample: random.Random
    hints: LocationHints
    metrics: LocalMetrics

    @in_batches()
    def lookup_sizes(self, keys: Sequence[str]) -> list[p.Found | None]:
        return expect(self.rpc.call(p.Lookup(list(keys), lease=False), idempotent=True), p.LookupReply).results

    @in_batches(aligned=1)
    def get(self, keys: Sequence[str], pieces: Sequence[Pieces] | None,
            exact: bool = True) -> tuple[list[MemCacheError | None], list[p.Found | None]]:
        """Read each key into its pieces. ``pieces`` None: only lease and return the locations.

        Per-key error or None; a key that is absent gets KeyNotFound. Never a partial success:
        a key whose bytes could not all be read, failed their checksum, or whose lease ran out
        while the space was reused, is an error.
        """
        results: list[MemCacheError | None] = [None] * len(keys)
        valid = [i for i in range(len(keys)) if valid_key(keys[i], results, i)]                    # plan
        t0 = time.monotonic()
        early = self._early_reads(keys, pieces, valid, exact) if pieces is not None else None     # early copy
        found, looked, lease_ttl_s = self._lookup(keys, valid, early)                             # lookup
        _settle(results, looked)
        if lease_ttl_s is None or pieces is None:
            return results, found
        todo, misfits = _fitting(keys, pieces, found, [i for i in valid if i not in looked], exact)
        _settle(results, misfits)
        self._read_found(keys, pieces, found, todo, early, results, t0, lease_ttl_s)
        return results, found

    @in_batches()
    def get_new(self, keys: Sequence[str]) -> tuple[list[MemCacheError | None], list[bytearray]]:
        """Read each key into a new buffer of its object's size: ``get`` with the buffers made between
        the ``Lookup`` and the copies, so one round trip tells both the size and the places (a missing
        or unread key: its error, and an empty buffer)."""
        results: list[MemCacheError | None] = [None] * len(keys)
        valid = [i for i in range(len(keys)) if valid_key(keys[i], results, i)]
        t0 = time.monotonic()
        found, looked, lease_ttl_s = self._lookup(keys, valid, None)
        _settle(results, looked)
        bufs = [bytearray() for _ in keys]
        if lease_ttl_s is None:
            return results, bufs
        pieces: list[Pieces] = [[] for _ in keys]
        anchors = []   # the buffers' views stay alive until their copies are done
        todo = []
        for i in valid:
            f = found[i]
            if i in looked or f is None or not f.size:   # absent (settled), or nothing to copy
                continue
            bufs[i] = bytearray(f.size)
            addr, n, anchor = buffer_address(bufs[i])
            anchors.append(anchor)
            pieces[i] = [(addr, n)]
            todo.append(i)
        self._read_found(keys, pieces, found, todo, None, results, t0, lease_ttl_s)
        return results, [b if e is None else bytearray() for e, b in zip(results, bufs, strict=True)]

    def _read_found(self, keys: Sequence[str], pieces: Sequence[Pieces], found: list[p.Found | None],
                    todo: list[int], early: _Early | None, results: list[MemCacheError | None], t0: float,
                    lease_ttl_s: float) -> None:
        """The copies of a ``get`` once its ``Lookup`` answered: the keys of ``todo`` (found, their buffers
        fitting) read into their pieces, the outcomes settled in ``results``."""
        suspect: set[int] = set()
        if early is not None and early.ran:
            todo, suspect = self._settle_early(early, found, todo)
        todo, on_disk = self._read_disk_only(keys, pieces, found, todo)                           # copy/verify
        _settle(results, on_disk)
        read, corrupt = self._read(keys, pieces, found, todo, suspect)
        _settle(results, read)
        _settle(results, self._disk_fallback(keys, pieces, found, todo, read))                    # fallback
        _log_misses(results, todo)
        if time.monotonic() - t0 > lease_ttl_s * LEASE_SAFETY:                                     # confirm
            _settle(results, self._confirm(keys, found, results))
        if corrupt:
            self._report_corrupt(corrupt)

    def _early_reads(self, keys: Sequence[str], pieces: Sequence[Pieces], valid: list[int],
                     exact: bool) -> _Early | None:
        """Copies of the objects this client remembers for these keys (``hints.py``), from their
        nearest replica in a segment known here, to run while the ``Lookup`` is on the way."""
        if not valid or self.engine is None or not self.hints.worth_trying():
            return None
        ops = []
        for i, f in zip(valid, self.hints.get(keys[i] for i in valid), strict=True):
            if f is None or _misfit(keys[i], pieces[i], f, exact) is not None:
                continue
            loc = self._replica_order(f.locations)[0]
            seg = self._segments.get(loc.segment_id)
            if seg is not None:
                op = self._copy_op(keys[i], pieces[i], f, seg, loc.offset)
                op.fallback = True    # a guess: a peer that stalls it is left for the read proper
                ops.append((i, op))
        return _Early(ops) if ops else None

    def _settle_early(self, early: _Early, found: list[p.Found | None],
                      todo: list[int]) -> tuple[list[int], set[int]]:
        """The keys of ``todo`` still to read, and those among them whose read must be verified: an
        early copy counts where it succeeded and the reply names the object it read (same generation,
        size and checksum, at the place it read from, a segment still known as the one it read).
        Every other early copy is thrown away; one of that very object that failed its checksum
        makes the key's next read verified, whatever ``checksum_verify_ratio`` samples."""
        done, suspect = set(), set()
        for i, op in early.ops:
            f = found[i]
            if (f is not None and f.generation == op.generation
                    and f.size == op.nbytes and f.checksum == op.checksum
                    and self._segments.get(op.segment.segment_id) == op.segment
                    and any(loc.segment_id == op.segment.segment_id and loc.offset == op.offset
                            for loc in f.locations)):
                if op.error is None:
                    done.add(i)
                elif isinstance(op.error, errors.ChecksumMismatch):
                    suspect.add(i)
        discarded = len(early.ops) - len(done)
        self.hints.outcome(len(done), discarded)
        self.metrics.early_read(len(done), discarded)
        return ([i for i in todo if i not in done] if done else todo), suspect

    def _lookup(self, keys: Sequence[str], valid: list[int], early: _Early | None
                ) -> tuple[list[p.Found | None], Outcomes, float | None]:
        """Lease the objects of the ``valid`` keys: what was found per key, the keys settled (absent,
        or every valid key when the lookup failed) and the lease in seconds (None when no lookup was
        made or it failed). The ``early`` copies run once the request is sent, before its reply is read."""
        found: list[p.Found | None] = [None] * len(keys)
        if not valid:
            return found, {}, None
        wanted = [keys[i] for i in valid]
        try:
            reply = expect(self.rpc.call(p.Lookup(wanted, lease=True), idempotent=True,
                                         meanwhile=early.run(self.engine) if early is not None else None),
                           p.LookupReply)
        except MemCacheError as e:
            return found, dict.fromkeys(valid, e), None
        self.hints.seen(wanted, reply.results)
        absent: Outcomes = {}
        for i, f in zip(valid, reply.results, strict=True):
            found[i] = f
            if f is None:
                absent[i] = errors.KeyNotFound(f"key {keys[i]!r} does not exist")
        return found, absent, reply.lease_ttl_ms / 1000.0

    def _read_disk_only(self, keys: Sequence[str], pieces: Sequence[Pieces], found: list[p.Found | None],
                        todo: list[int]) -> tuple[list[int], Outcomes]:
        """Objects evicted to a provider's disk tier: that provider serves the bytes (``tier.py``).
        Returns the keys of ``todo`` left for their DRAM replicas, and the outcomes of the others."""
        on_disk = [i for i in todo if not found[i].locations]  # type: ignore[union-attr]
        if not on_disk:
            return todo, {}
        read = tier.read_disk(self, list(keys), list(pieces), found, on_disk, self._verify_disk())
        return [i for i in todo if found[i].locations], read  # type: ignore[union-attr]

    def _disk_fallback(self, keys: Sequence[str], pieces: Sequence[Pieces], found: list[p.Found | None],
                       todo: list[int], read: Outcomes) -> Outcomes:
        """The keys of ``todo`` whose every DRAM copy failed (those in ``read``): the provider's disk
        record is one more replica. Their outcomes."""
        fallback = [i for i in todo if i in read and found[i].disk] if read else []  # type: ignore[union-attr]
        if not fallback:
            return {}
        return tier.read_disk(self, list(keys), list(pieces), found, fallback, self._verify_disk())

    def _verify_disk(self) -> bool:
        return self.config.checksum and self.config.checksum_verify_ratio > 0

    def _read(self, keys: Sequence[str], pieces: Sequence[Pieces], found: list[p.Found | None],
              todo: list[int], verify: set[int]) -> tuple[Outcomes, list[tuple[str, int, int]]]:
        """Read each key from its replicas in turn, nearest first; a replica that fails (a dead or
        unknown peer, bytes failing their checksum) is followed by the next. The keys in ``verify``
        are verified whatever the sampling. Returns the keys not read, with the error of the last replica
        tried (a key read is not among them), and the corrupt replicas as (key, generation, segment id)."""
        assert self.engine is not None
        read: Outcomes = {}
        corrupt: list[tuple[str, int, int]] = []
        attempt = {i: list(found[i].locations) for i in todo}  # type: ignore[union-attr]
        self._know_segments([loc for locs in attempt.values() if len(locs) > 1 for loc in locs])
        attempt = {i: self._replica_order(locs) for i, locs in attempt.items()}
        while todo:
            ops, owners = [], []
            for i in todo:
                f, (seg, unknown) = found[i], self._next_replica(attempt[i])
                if unknown is not None:
                    read[i] = unknown
                if seg is None or f is None:
                    continue
                op = self._copy_op(keys[i], pieces[i], f, seg[0], seg[1], i in verify)
                op.fallback = bool(attempt[i] or f.disk)    # somewhere else to go: a stalled peer is left
                ops.append(op)
                owners.append(i)
            self.engine.read(ops)
            todo = []
            for i, op in zip(owners, ops, strict=True):
                if op.error is None:
                    if read:
                        read.pop(i, None)   # an earlier replica's failure no longer counts
                    continue
                read[i] = op.error
                if isinstance(op.error, errors.ChecksumMismatch):
                    self.integrity_failures += 1
                    logger.error("integrity failure: %s", op.error)
                    corrupt.append((op.key, op.generation, op.segment.segment_id))
                if attempt[i]:
                    logger.info("reading %r from segment %d failed (%s); trying another replica", op.key,
                                op.segment.segment_id, op.error)
                    todo.append(i)
        return read, corrupt

    def _copy_op(self, key: str, pieces: Pieces, f: p.Found, seg: p.SegmentInfo, offset: int,
                 force_verify: bool = False) -> CopyOp:
        """The read of object ``f``'s replica at ``offset`` in ``seg`` into ``pieces``; verified
        against its checksum when the checksum sampling says so (or ``force_verify``)."""
        ratio = self.config.checksum_verify_ratio if self.config.checksum else 0.0
        verify = (ratio >= 1.0 or (ratio > 0 and self._sample.random() < ratio)
                  or (force_verify and self.config.checksum))
        return CopyOp(seg, offset, clip(pieces, f.size), f.size, key, f.generation, f.checksum, hash=verify)

    def _know_segments(self, locs: list[p.Location]) -> None:
        """Fetch the segment table once when replicas lie in segments not known here (to rank them)."""
        if any(loc.segment_id not in self._segments for loc in locs):
            try:
                self._refresh_segments()
            except MemCacheError as e:
                logger.debug("segment table not refreshed: %s", e)

    def _next_replica(self, left: list[p.Location]
                      ) -> tuple[tuple[p.SegmentInfo, int] | None, MemCacheError | None]:
        """The next replica in ``left`` whose segment is in the pool, as (segment, offset), and the
        error of the last replica passed over because its segment is not (None when none was)."""
        unknown = None
        while left:
            loc = left.pop(0)
            try:
                return (self.segment_info(loc.segment_id), loc.offset), unknown
            except MemCacheError as e:
                unknown = e
        return None, unknown

    def _report_corrupt(self, corrupt: list[tuple[str, int, int]]) -> None:
        try:
            self.member_call(lambda s: p.Corrupt(s.client_id, s.token, [k for k, _, _ in corrupt],
                                                  [g for _, g, _ in corrupt], [sid for _, _, sid in corrupt]))
        except MemCacheError as e:
            logger.warning("could not report %d corrupt objects: %s", len(corrupt), e)

    def _replica_order(self, locs: list[p.Location]) -> list[p.Location]:
        """Our own segment first, then segments on this host (shared memory, or TCP over loopback),
        then the others in the MetaService's order; a peer that missed a read deadline lately
        (``TcpClient.suspect``) after all of them."""
        if len(locs) == 1:
            return locs

        def rank(loc: p.Location) -> tuple[bool, int]:
            seg = self._segments.get(loc.segment_id)
            suspect = seg is not None and self.engine is not None and self.engine.suspect(seg)
            return suspect, replica_distance(seg, self.segment, self.host_id)
        return sorted(locs, key=rank)

    def _confirm(self, keys: Sequence[str], found: list[p.Found | None],
                 results: list[MemCacheError | None]) -> Outcomes:
        """The reads outlived their lease: those of ``results`` whose objects were replaced since
        become errors (the outcomes returned)."""
        idx = [i for i, r in enumerate(results) if r is None and found[i] is not None]
        if not idx:
            return {}
        try:
            flags = expect(self.rpc.call(p.Validate([keys[i] for i in idx],
                                                    [found[i].generation for i in idx]),  # type: ignore[union-attr]
                                         idempotent=True), p.Flags).flags
        except MemCacheError as e:
            flags = [False] * len(idx)
            logger.warning("could not confirm %d reads that outlived their lease: %s", len(idx), e)
        return {i: errors.LeaseExpired(f"{keys[i]!r} changed while a slow read held an expired lease")
                for i, ok in zip(idx, flags, strict=True) if not ok}


class _Early:
    """Early copies (``hints.py``): (key index, op) pairs, and whether they ran."""

    def __init__(self, ops: list[tuple[int, CopyOp]]) -> None:
        self.ops = ops
        self.ran = False

    def run(self, engine: TransferEngine | None) -> Callable[[], None]:
        def copy() -> None:
            assert engine is not None
            engine.read([op for _, op in self.ops])
            self.ran = True
        return copy


def replica_distance(seg: p.SegmentInfo | None, own: Mapping | None, host_id: str) -> int:
    """How near a replica is: 0 in our own segment, 1 on this host, 2 elsewhere, 3 not known here."""
    if seg is None:
        return 3
    if own is not None and seg.shm_path == own.path:
        return 0
    return 1 if seg.host_id == host_id else 2



def _log_misses(results: list[MemCacheError | None], todo: list[int]) -> None:
    """A miss the engine will recompute: say why, once per batch."""
    failed = [e for e in (results[i] for i in todo) if e is not None]
    if failed:
        logger.warning("%d of %d objects could not be read; first: %s: %s", len(failed), len(todo),
                       type(failed[0]).__name__, failed[0])


def _settle(results: list[MemCacheError | None], outcomes: Outcomes) -> None:
    """Write a stage's outcomes into the per-key results (``get`` alone calls it)."""
    for i, e in outcomes.items():
        results[i] = e


def _fitting(keys: Sequence[str], pieces: Sequence[Pieces], found: list[p.Found | None], idx: list[int],
             exact: bool) -> tuple[list[int], Outcomes]:
    """The keys of ``idx`` whose buffers hold their object, and the errors of the others."""
    fit: list[int] = []
    misfits: Outcomes = {}
    for i in idx:
        e = _misfit(keys[i], pieces[i], found[i], exact)
        if e is None:
            fit.append(i)
        else:
            misfits[i] = e
    return fit, misfits


def _misfit(key: str, pieces: Pieces, f: p.Found | None, exact: bool) -> InvalidParameter | None:
    """None when the pieces hold object ``f`` (exactly, or at least), else the error saying why not."""
    assert f is not None
    want = sum(map(itemgetter(1), pieces))
    if (want != f.size) if exact else (want < f.size):
        return InvalidParameter(f"buffer of {want} bytes for {key!r} of {f.size} bytes")
    return None
