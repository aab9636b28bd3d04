"""Put, in named phases: validate -> allocate -> copy -> commit / abort.

Put is two-phase on the MetaService: ``Alloc`` (objects PENDING), copy payload and header, ``Commit``
(visible, with the payload checksum), or ``Abort`` on failure. Small objects of one replica go
through our allocation arena instead (``arena.py``): copy, then one ``ArenaCommit``. A key another writer has pending is
waited for, never reported as stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from .. import errors
from .. import protocol as p
from ..errors import MemCacheError, valid_key
from ..fence import tokens
from ..rpc import Backoff, expect
from ..transfer import CopyOp
from .arena import ArenaWriter
from .membership import Membership, Pieces, Session, in_batches

logger = logging.getLogger(__name__)


class Writes(Membership):
    """``LocalService.put`` and its phases (a mixin)."""

    _partial_warned: float   # when a partial placement may be logged again
    arenas: ArenaWriter | None   # small puts in one round trip (arena.py); None without a segment

    @in_batches(aligned=1)
    def put(self, keys: Sequence[str], pieces: Sequence[Pieces], replicas: int = 1,
            preferred: Sequence[int] = ()) -> list[MemCacheError | None]:
        """Store each key's pieces (laid end to end) as one object. Per-key error or None."""
        results: list[MemCacheError | None] = [None] * len(keys)
        todo = _unique_valid(keys, results)   # key -> index; the same key twice: the first put stands
        if not todo:
            return results
        sizes = {k: sum(n for _, n in pieces[i]) for k, i in todo.items()}
        if self.arenas is not None and replicas == 1 and set(preferred) <= {self.client_id}:
            n = len(todo)
            todo = self._put_small(todo, sizes, pieces, results)
            stored = len(todo) < n
            sizes = {k: sizes[k] for k in todo}   # what is left for the two-phase put
        else:
            stored = False
        epochs: dict[str, list[int]] = {}   # key -> per location, the fence token its space was granted under
        allocated = self._alloc(sizes, replicas, preferred, results, todo, epochs) if todo else {}
        self._note_partial(allocated, replicas)
        s = self.session   # the session the allocation was made in (a re-join may have replaced it)
        ops = self._copy(s, allocated, pieces, results, todo, epochs)
        self._finish_put(s, allocated, ops, results, todo)
        if self.disk is not None and (allocated or stored):
            self.disk.poke()   # our segment may have grown: the disk tier asks for copies now
        return results

    def _put_small(self, todo: dict[str, int], sizes: dict[str, int], pieces: Sequence[Pieces],
                   results: list[MemCacheError | None]) -> dict[str, int]:
        """Put the small objects through our arena (``arena.py``); the keys left for the two-phase put."""
        assert self.arenas is not None
        limit = self.config.small_put_max_bytes
        small = [k for k in todo if sizes[k] <= limit]
        if not small:
            return todo
        done, _ = self.arenas.put(self.session, small, [pieces[todo[k]] for k in small], [sizes[k] for k in small])
        for k, e in done.items():
            results[todo[k]] = e
        return {k: i for k, i in todo.items() if k not in done}

    def _alloc(self, sizes: dict[str, int], replicas: int, preferred: Sequence[int],
               results: list[MemCacheError | None], todo: dict[str, int],
               epochs: dict[str, list[int]]) -> dict[str, p.AllocResult]:
        """Allocate space; wait out other writers' pending puts of the same keys (bounded). ``epochs``:
        filled with the fence tokens each key's space was granted under (``fence.py``)."""
        allocated: dict[str, p.AllocResult] = {}
        want = list(sizes)
        deadline = time.monotonic() + min(self.session.pending_timeout_s / 2, self.config.client_timeout_seconds)
        backoff = Backoff(0.002, 0.05)
        again: set[str] = set()   # stored only with a dead owner: put once more
        while want:
            try:
                answer, granted_in = self.member_call_in(lambda s, w=want: p.Alloc(  # type: ignore[misc]
                    s.client_id, s.token, w, [sizes[k] for k in w], replicas, list(preferred)))
                reply = expect(answer, p.AllocReply)
            except MemCacheError as e:
                for k in want:
                    results[todo[k]] = e
                return allocated
            busy, existing = [], {}
            for k, res in zip(want, reply.results, strict=True):
                if res.code == errors.SUCCESS:
                    try:
                        epochs[k] = tokens(res.fences, len(res.locations), granted_in.epoch, f"put of {k!r}")
                    except MemCacheError as e:
                        results[todo[k]] = e
                        continue
                    allocated[k] = res
                elif res.code == errors.WRITE_IN_PROGRESS:
                    busy.append(k)
                elif res.code == errors.OBJECT_ALREADY_EXISTS:   # existing: these bytes are stored...
                    existing[k] = res
                else:
                    results[todo[k]] = errors.error_from_code(res.code, f"cannot put {k!r} ({sizes[k]} bytes)")
            for k in self._stored_with_the_dead(existing):   # ...unless they leave the pool with a dead owner
                if k in again:
                    results[todo[k]] = errors.PeerUnavailable(f"{k!r} is stored only in segments whose owner died")
                else:
                    again.add(k)
                    busy.append(k)
            if busy and time.monotonic() >= deadline:
                for k in busy:
                    results[todo[k]] = errors.WriteInProgress(f"another writer's put of {k!r} is still pending")
                break
            if busy:
                time.sleep(backoff.next())
            want = busy
        return allocated

    def _stored_with_the_dead(self, existing: dict[str, p.AllocResult]) -> list[str]:
        """Keys already stored (so a put of them is a no-op), but only in segments of this host whose
        owner is dead: they leave the pool with it. Their owners are reported (``owners_gone``: the
        MetaService drops them at once), so an Alloc of these keys again places them anew."""
        segs: dict[int, p.SegmentInfo] = {}
        for res in existing.values():
            for loc in res.locations:
                if loc.segment_id not in segs:
                    try:
                        segs[loc.segment_id] = self.segment_info(loc.segment_id)
                    except MemCacheError:
                        pass   # out of the pool already: so are its objects
        gone = self.owners_gone(self.session, segs)
        return [k for k, res in existing.items() if gone and res.locations
                and all(loc.segment_id in gone for loc in res.locations)]

    def _note_partial(self, allocated: dict[str, p.AllocResult], replicas: int) -> None:
        """Fewer segments with room than replicas: the put is placed partially (``get_key_info``
        shows where) and succeeds once every placed replica is written; say so (at most once a minute)."""
        short = [k for k, r in allocated.items() if len(r.locations) < replicas]
        if short and time.monotonic() >= self._partial_warned:
            self._partial_warned = time.monotonic() + 60.0
            logger.warning("%d objects (first %r: %d of %d replicas) were placed on fewer segments than "
                           "replicaNum asks for: the pool has too few segments with room",
                           len(short), short[0], len(allocated[short[0]].locations), replicas)

    def _copy(self, s: Session, allocated: dict[str, p.AllocResult], pieces: Sequence[Pieces],
              results: list[MemCacheError | None], todo: dict[str, int], epochs: dict[str, list[int]],
              ) -> list[CopyOp]:
        """Write every allocated replica; a copy that cannot start in time fails instead, and one whose
        segment's owner re-joined since its space was granted is refused by the segment's fence."""
        t_alloc = time.monotonic()
        ops = self._write_ops(allocated, pieces, results, todo, epochs)
        if ops and time.monotonic() - t_alloc >= s.pending_timeout_s / 2:
            for op in ops:   # too late to start: the MetaService may reclaim the space while we copy
                op.error = errors.TransferFailed("put took longer than half the pending timeout")
        elif ops:
            assert self.engine is not None
            self.engine.write(ops)
        for op in ops:
            i = todo[op.key]
            if op.error is not None and results[i] is None:
                results[i] = op.error
        return ops

    def _write_ops(self, allocated: dict[str, p.AllocResult], pieces: Sequence[Pieces],
                   results: list[MemCacheError | None], todo: dict[str, int], epochs: dict[str, list[int]],
                   ) -> list[CopyOp]:
        ops: list[CopyOp] = []
        for key, res in allocated.items():
            i = todo[key]
            size = sum(n for _, n in pieces[i])
            for loc, fence in zip(res.locations, epochs[key], strict=True):
                try:
                    seg = self.segment_info(loc.segment_id)
                except MemCacheError as e:
                    results[i] = e
                    break
                ops.append(CopyOp(seg, loc.offset, list(pieces[i]), size, key, res.generation,
                                  hash=self.config.checksum, epoch=fence))
        return ops

    def _finish_put(self, s: Session, allocated: dict[str, p.AllocResult], ops: list[CopyOp],
                    results: list[MemCacheError | None], todo: dict[str, int]) -> None:
        checksum = {op.key: op.checksum for op in ops}
        commit = [k for k in allocated if results[todo[k]] is None]
        abort = [k for k in allocated if results[todo[k]] is not None]
        if abort:
            try:
                self.rpc.call(p.Abort(s.client_id, s.token, abort, [allocated[k].generation for k in abort]))
            except MemCacheError as e:
                logger.warning("abort of %d failed puts not delivered (%s); the MetaService reclaims them",
                               len(abort), e)
        if not commit:
            return
        try:
            codes = expect(self.rpc.call(p.Commit(s.client_id, s.token, commit,
                                                  [allocated[k].generation for k in commit],
                                                  [checksum[k] for k in commit])), p.Codes).codes
        except MemCacheError as e:
            codes = [e.code] * len(commit)
        for k, code in zip(commit, codes, strict=True):
            if code != errors.SUCCESS:
                results[todo[k]] = errors.error_from_code(code, f"commit of {k!r} refused")
        # after the commit, never before: an owner alive now held the object when it became visible
        stored = [op for op in ops if results[todo[op.key]] is None]
        gone = self.owners_gone(s, {op.segment.segment_id: op.segment for op in stored})
        for op in stored:
            if op.segment.segment_id in gone:
                results[todo[op.key]] = errors.PeerUnavailable(
                    f"put of {op.key!r}: the owner of segment {op.segment.segment_id} died (it leaves the pool "
                    f"with its objects)")


def _unique_valid(keys: Sequence[str], results: list[MemCacheError | None]) -> dict[str, int]:
    todo: dict[str, int] = {}
    for i, key in enumerate(keys):
        if valid_key(key, results, i) and key not in todo:
            todo[key] = i
    return todo

