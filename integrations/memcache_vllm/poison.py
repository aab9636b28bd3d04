"""Scheduler side: the KV-cache blocks whose bytes are not what their prefix says.

A block that failed to load holds wrong bytes, and so does every block computed while reading
it. vLLM (``kv_load_failure_policy: recompute``) reschedules the requests that read such a block,
but keeps the block in its prefix cache, and when the request that would rewrite it is aborted or
preempted first, the wrong bytes stay there under the prefix's hash: the next request with that
prefix (or the preempted request itself, when it resumes) gets a local hit on them, and its own
blocks, computed over them, would be saved to the pool.

So this side keeps the set of poisoned blocks (vLLM's block ids) itself:

* ``failed(invalid, chains)``: the blocks the workers could not load, and every block after one of
  them in the block list of a request that holds it, are poisoned.
* ``loaded(ids)``: a load rewrites these blocks (when it fails, they come back through ``failed``).
* ``step(writes)``: what each scheduled request computes in this step. A block rewritten in full
  by a computation that read no poisoned block is clean again; every block written by one that
  read a poisoned block is poisoned. Several requests of one step read each other's blocks of
  that step (every layer writes the step's KV before its attention reads it), so both rules are
  applied until nothing changes.

Each call returns the blocks it poisoned: the scheduler evicts them from vLLM's prefix cache at
once, so no request gets a local hit on them again (a request that still holds one keeps it; vLLM
recomputes it there or never reads it again). A save is never issued while a block its
computation read (the request's blocks up to the last one saved) is poisoned.

A block is poisoned from a token offset on: a rewrite may reach it in several steps (chunked
prefill), and the request continuing it reads its own rewritten part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Write:
    """What one request computes in a step: its block ids, and the tokens ``[start, end)``."""

    block_ids: Sequence[int]
    start: int
    end: int


class PoisonedBlocks:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._clean_upto: dict[int, int] = {}
        """Poisoned block id -> how many of its first tokens are rewritten over clean bytes."""

    def __len__(self) -> int:
        return len(self._clean_upto)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._clean_upto

    def any(self, block_ids: Iterable[int]) -> bool:
        """Whether any of these blocks is (still partly) poisoned."""
        return bool(self._clean_upto) and any(b in self._clean_upto for b in block_ids)

    def failed(self, invalid: set[int], chains: Iterable[Sequence[int]]) -> set[int]:
        """Blocks that did not load, and every block after one in a chain holding it."""
        new = {b for b in invalid if self._poison(b, 0)}
        for chain in chains:
            first = next((i for i, b in enumerate(chain) if b in invalid), None)
            if first is not None:
                new.update(b for b in chain[first:] if self._poison(b, 0))
        return new

    def loaded(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            self._clean_upto.pop(b, None)

    def step(self, writes: Sequence[Write]) -> set[int]:
        """Apply one step's computations; returns every block written over poison (vLLM caches a
        block when it allocates it, before the step computes it: each must be evicted again)."""
        if not self._clean_upto:
            return set()
        changed = True
        while changed:  # clean rewrites (only ever remove)
            changed = False
            for w in writes:
                if not self._reads_poison(w):
                    for b, lo, hi in self._pieces(w):
                        upto = self._clean_upto.get(b)
                        if upto is None or upto < lo:
                            continue
                        if hi >= self.block_size:
                            del self._clean_upto[b]
                            changed = True
                        elif hi > upto:
                            self._clean_upto[b] = hi
                            changed = True
        new: set[int] = set()
        changed = True
        while changed:  # writes over poison (only ever add)
            changed = False
            for w in writes:
                if self._reads_poison(w):
                    for b, lo, _ in self._pieces(w):
                        new.add(b)
                        changed = self._poison(b, lo) or changed
        return new

    def forget(self, keep: Callable[[int], bool]) -> None:
        """Drop the blocks ``keep`` rejects: a block no request holds, and that is out of the
        prefix cache, is written in full by its next owner before anyone reads it."""
        self._clean_upto = {b: upto for b, upto in self._clean_upto.items() if keep(b)}

    # -- internals ---------------------------------------------------------------------------

    def _poison(self, block_id: int, offset: int) -> bool:
        """Poison ``block_id`` from token ``offset`` on; True when that made it (more) poisoned."""
        upto = self._clean_upto.get(block_id)
        if upto is not None and upto <= offset:
            return False
        self._clean_upto[block_id] = offset
        return True

    def _reads_poison(self, w: Write) -> bool:
        """Whether the computation reads a poisoned token before the ones it writes."""
        s, off = divmod(w.start, self.block_size)
        if self.any(w.block_ids[:s]):
            return True
        if off and s < len(w.block_ids):
            upto = self._clean_upto.get(w.block_ids[s])
            return upto is not None and upto < off
        return False

    def _pieces(self, w: Write) -> list[tuple[int, int, int]]:
        """(block id, first, end token offset within the block) of each block the write touches."""
        bs = self.block_size
        out = []
        for i in range(w.start // bs, min(-(-w.end // bs), len(w.block_ids))):
            out.append((w.block_ids[i], max(w.start - i * bs, 0), min(w.end - i * bs, bs)))
        return out
