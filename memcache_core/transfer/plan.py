"""Cutting a batch of shared-memory copies into runs and the runs into equal parts, one per copy thread.

A run is ``(op index, destination, source, bytes)``: one ``memmove``. Pieces of an object that are
adjacent in the caller's memory are one run (the object side is always contiguous), so a layout whose
pieces happen to touch costs one call instead of one per piece. ``split_runs`` cuts the runs into
parts of about equal bytes, keeping their order and cutting a run where a part's share ends (at a
multiple of ``align`` bytes from the run's start), so that one large piece is copied by several
threads too.
"""

from __future__ import annotations

Run = tuple[int, int, int, int]     # (op index, destination address, source address, bytes)


def coalesce(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pieces with each one that starts where the previous one ends merged into it."""
    out: list[tuple[int, int]] = []
    for ptr, size in pieces:
        if out and out[-1][0] + out[-1][1] == ptr:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((ptr, size))
    return out


def split_runs(runs: list[Run], parts: int, align: int = 4096) -> list[list[Run]]:
    """At most ``parts`` lists of runs of about equal bytes, in order; a run that crosses a part's
    boundary is cut there (rounded to ``align`` from its start; never into a piece under ``align``)."""
    total = sum(r[3] for r in runs)
    if parts <= 1 or total <= align:
        return [list(runs)] if runs else []
    share = total / parts
    out: list[list[Run]] = [[]]
    done = 0                                    # bytes placed in the parts so far
    for i, dst, src, n in runs:
        while n:
            room = share * len(out) - done      # what the current part still takes
            cut = int(room) // align * align
            if len(out) == parts or n - cut < align or room >= n:
                out[-1].append((i, dst, src, n))
                done += n
                break
            if cut >= align:
                out[-1].append((i, dst, src, cut))
                dst, src, n, done = dst + cut, src + cut, n - cut, done + cut
            out.append([])
    return [p for p in out if p]


def ops_per_part(parts: list[list[Run]], nops: int) -> list[int]:
    """How many parts hold runs of each op (1: the op is copied by one thread from end to end)."""
    count = [0] * nops
    for part in parts:
        seen = -1
        for run in part:
            if run[0] != seen:
                seen = run[0]
                count[seen] += 1
    return count
