"""The load-failure fence of one worker rank: no save of blocks computed over a block that failed
to load.

When blocks fail to load, vLLM reschedules (with ``kv_load_failure_policy: recompute``) every
request whose computed blocks include one, but only after the step's output reached the
scheduler. Until then, whatever the forward computed over such a block is wrong: the failing
request's own blocks, and those of any request that shares the block through vLLM's local prefix
cache (scheduled in the same step, before the load ran). With async scheduling the step after
the failure was scheduled before the failure was known, and computes over it too.

So every failure opens a new epoch on this rank and fences its blocks. A save is skipped while any
block its computation read (the request's blocks up to the last one saved) is fenced. The rank
reports its epoch with the failed blocks; the scheduler, after vLLM has rescheduled the affected
requests, acknowledges it in the metadata of the next step it builds, and only from that step on
are the fences of that epoch (and earlier) lifted. Under async scheduling that is the step after
the in-flight one, whose saves therefore stay fenced.

    fail(blocks)  -> epoch e; blocks fenced        (load done, before the forward)
    fenced(ids)   -> True while any id is fenced   (wait_for_save, after the forward)
    take_report() -> e, once                        (worker -> scheduler, same step output)
    acknowledge(e)                                  (scheduler -> worker, a later step, before
                                                     its forward)
"""

from __future__ import annotations

from collections.abc import Iterable


class LoadFailureFence:
    def __init__(self) -> None:
        self._epoch = 0
        self._reported = 0
        self._fenced: dict[int, int] = {}
        """Block id -> epoch of the failure that fenced it."""

    @property
    def epoch(self) -> int:
        return self._epoch

    def fail(self, block_ids: Iterable[int]) -> int:
        """Blocks that did not load: a new epoch fences them. Returns the epoch."""
        ids = list(block_ids)
        if ids:
            self._epoch += 1
            for b in ids:
                self._fenced[b] = self._epoch
        return self._epoch

    def fenced(self, block_ids: Iterable[int]) -> bool:
        """Whether a computation that read these blocks may have read a failed one."""
        return bool(self._fenced) and any(b in self._fenced for b in block_ids)

    def take_report(self) -> int | None:
        """The epoch to report to the scheduler, when it changed since the last report."""
        if self._epoch == self._reported:
            return None
        self._reported = self._epoch
        return self._epoch

    def acknowledge(self, epoch: int) -> None:
        """The scheduler has handled every failure up to ``epoch``: lift their fences."""
        if self._fenced:
            self._fenced = {b: e for b, e in self._fenced.items() if e > epoch}

    def __len__(self) -> int:
        return len(self._fenced)
