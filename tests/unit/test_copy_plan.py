"""Cutting shared-memory copies into runs and parts (transfer/plan.py)."""

from __future__ import annotations

import random

import pytest

from memcache_core.transfer.plan import Run, coalesce, ops_per_part, split_runs


def test_coalesce_merges_only_touching_pieces() -> None:
    assert coalesce([]) == []
    assert coalesce([(100, 10), (110, 5), (115, 1)]) == [(100, 16)]
    assert coalesce([(100, 10), (111, 5), (116, 4), (0, 3)]) == [(100, 10), (111, 9), (0, 3)]
    assert coalesce([(100, 10), (100, 10)]) == [(100, 10), (100, 10)]   # overlapping: kept apart


def _bytes_of(parts: list[list[Run]]) -> list[tuple[int, int, int]]:
    """Every byte as (op, destination, source), in order, from runs."""
    return [(i, d + k, s + k) for part in parts for i, d, s, n in part for k in range(n)]


def _runs(sizes: list[int]) -> list[Run]:
    out, dst, src = [], 1 << 20, 1 << 30
    for i, n in enumerate(sizes):
        out.append((i, dst, src, n))
        dst, src = dst + n + 64, src + n + 320
    return out


@pytest.mark.parametrize("sizes,parts", [
    ([8_994_816], 2),                          # one large piece: cut in two
    ([8_994_816], 3),
    ([131072, 16384] * 61, 2),                 # a DeepSeek-shaped object
    ([131072, 16384] * 61 * 3, 4),
    ([4095, 4097, 1, 8191, 12289] * 40, 2),    # sizes around the page
    ([700] * 2000, 2),                         # many small pieces
    ([5000], 2),                               # barely more than one slice of align
    ([100, 200], 8),
])
def test_split_keeps_every_byte_once_in_order(sizes: list[int], parts: int) -> None:
    runs = _runs(sizes)
    out = split_runs(runs, parts, align=4096)
    assert 1 <= len(out) <= parts and all(out)
    flat = [r for p in out for r in p]
    assert sum(r[3] for r in flat) == sum(sizes)
    if sum(sizes) < 100_000:
        assert _bytes_of(out) == _bytes_of([runs])
    else:   # the same check, run by run: each op's runs abut and cover it
        for i, d, s, n in runs:
            mine = [r for r in flat if r[0] == i]
            assert mine[0][1:3] == (d, s) and sum(r[3] for r in mine) == n
            assert all(a[1] + a[3] == b[1] and a[2] + a[3] == b[2] for a, b in zip(mine, mine[1:], strict=False))


@pytest.mark.parametrize("sizes,parts", [([8_994_816], 2), ([131072, 16384] * 61 * 8, 2),
                                         ([131072, 16384] * 61 * 8, 3), ([1 << 20] * 7, 4)])
def test_split_balances_bytes(sizes: list[int], parts: int) -> None:
    out = split_runs(_runs(sizes), parts)
    assert len(out) == parts
    share = sum(sizes) / parts
    for p in out:   # runs are cut where a share ends, so every part is within two slices of its share
        assert abs(sum(r[3] for r in p) - share) <= 2 * 4096


def test_cuts_are_aligned_from_the_run_start() -> None:
    out = split_runs([(0, 1000, 5000, 10_000_000)], 3, align=4096)
    assert [r[3] % 4096 for r in out[0] + out[1]] == [0, 0]
    assert [r[1] - 1000 for p in out for r in p] == [r[2] - 5000 for p in out for r in p]


def test_equal_objects_are_cut_between_objects() -> None:
    out = split_runs(_runs([8_994_816] * 8), 2)
    assert [len(p) for p in out] == [4, 4]
    assert ops_per_part(out, 8) == [1] * 8


def test_one_part_and_small_batches_are_left_whole() -> None:
    runs = _runs([100, 200, 300])
    assert split_runs(runs, 1) == [runs]
    assert split_runs(runs[:1], 4, align=4096) == [runs[:1]]
    assert split_runs([], 4) == []


def test_ops_per_part_counts_cut_ops() -> None:
    out = split_runs(_runs([8_994_816, 8_994_816, 8_994_816]), 2)
    assert ops_per_part(out, 3) == [1, 2, 1]


def test_random_layouts_cover_every_byte() -> None:
    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.choice((1, 63, 4096, 4097, 16384, 131072, rng.randint(1, 300_000)))
                 for _ in range(rng.randint(1, 40))]
        out = split_runs(_runs(sizes), rng.randint(1, 6), align=rng.choice((64, 4096)))
        flat = [r for p in out for r in p]
        assert sum(r[3] for r in flat) == sum(sizes)
        assert [r[0] for r in flat] == sorted(r[0] for r in flat)
        assert all(r[3] > 0 for r in flat)
