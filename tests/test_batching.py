"""The variable-length batch scheduler (Turbo's DP) against brute force, and its baselines."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opara_core.planning import batching
from opara_core.planning.batching import CostTable

SEQUENCE = (16, 32, 64, 128)
BATCHES = (1, 2, 4)


@st.composite
def tables(draw, axes=((16, 32, 64, 128),), batches=BATCHES, monotone=True) -> CostTable:
    """Integer costs (exact sums); with `monotone`, never cheaper at a longer bucket."""
    shapes = batching.grid(axes)
    seconds = {}
    for b in batches:
        running = 0
        for shape in shapes:  # smallest first: cumulative keeps the cost monotone along the order
            step = draw(st.integers(0, 50))
            running = running + step if monotone else step
            seconds[(shape, b)] = running
    return CostTable(axes, batches, seconds)


def lengths(axes=1, limit=128, max_size=7):
    return st.lists(st.tuples(*[st.integers(1, limit)] * axes), min_size=1, max_size=max_size)


def set_partitions(items: list[int]):
    """Every partition of `items` into non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for k in range(len(partition)):
            yield [*partition[:k], [first, *partition[k]], *partition[k + 1 :]]


def partition_cost(blocks, lens, table: CostTable) -> float:
    """Each block on the cheapest cell of the table that holds it, by search."""
    total = 0
    for block in blocks:
        longest = tuple(max(axis) for axis in zip(*(lens[i] for i in block)))
        fits = [cost for (shape, batch), cost in table.seconds.items() if batch >= len(block) and all(map(int.__ge__, shape, longest))]
        if not fits:
            return float("inf")
        total += min(fits)
    return total


def assert_valid(groups, lens, table: CostTable) -> None:
    """Every request exactly once, each group fits its shape and batch bucket."""
    assert sorted(i for g in groups for i in g.items) == list(range(len(lens)))
    for g in groups:
        assert 1 <= len(g.items) <= g.batch <= table.max_batch and g.batch in table.batches
        assert g.shape in table.shapes()
        assert all(n <= s for i in g.items for n, s in zip(lens[i], g.shape))


@settings(max_examples=150, deadline=None)
@given(lens=lengths(), table=tables(monotone=False))
def test_dp_equals_the_best_of_all_partitions_for_any_costs(lens, table):
    groups = batching.dp(lens, table)
    assert_valid(groups, lens, table)
    best = min(partition_cost(p, lens, table) for p in set_partitions(list(range(len(lens)))))
    assert batching.total_cost(groups, table) == best


@settings(max_examples=150, deadline=None)
@given(lens=lengths(axes=2, max_size=6), table=tables(axes=((16, 64, 128), (16, 128)), monotone=False))
def test_dp_equals_the_best_split_of_the_sorted_order_for_any_costs(lens, table):
    groups = batching.dp(lens, table)
    assert_valid(groups, lens, table)
    order = sorted(range(len(lens)), key=lambda i: (lens[i], i))
    best = float("inf")
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        blocks, start = [], 0
        for k, cut in enumerate(cuts, start=1):
            if cut:
                blocks.append(order[start:k])
                start = k
        blocks.append(order[start:])
        best = min(best, partition_cost(blocks, lens, table))
    assert batching.total_cost(groups, table) == best


@settings(max_examples=100, deadline=None)
@given(lens=lengths(max_size=20), table=tables())
def test_the_baselines_are_valid_and_never_cheaper_than_dp(lens, table):
    dp_cost = batching.total_cost(batching.dp(lens, table), table)
    for name in ("greedy", "padded", "single"):
        groups = batching.SCHEDULERS[name](lens, table)
        assert_valid(groups, lens, table)
        assert batching.total_cost(groups, table) >= dp_cost


def test_greedy_groups_by_bucket_and_padded_uses_the_largest():
    table = CostTable((SEQUENCE,), BATCHES, {((s,), b): s * b for s in SEQUENCE for b in BATCHES})
    lens = [(10,), (100,), (12,), (20,), (16,)]
    assert [(g.items, g.shape, g.batch) for g in batching.greedy(lens, table)] == [
        ((0, 2, 4), (16,), 4),
        ((3,), (32,), 1),
        ((1,), (128,), 1),
    ]
    assert [(g.shape, g.batch) for g in batching.padded(lens, table)] == [((128,), 4), ((128,), 1)]
    assert [g.items for g in batching.single(lens, table)] == [(0,), (1,), (2,), (3,), (4,)]


def test_a_group_runs_on_a_cheaper_cell_that_holds_it():
    # an H100's BERT costs (ms): batch 1 at 16 tokens took longer than batch 1 at 32 and batch 2 at 16
    seconds = {((s,), b): 10.0 for s in SEQUENCE for b in BATCHES}
    seconds.update({((16,), 1): 1.937, ((16,), 2): 1.540, ((32,), 1): 1.527, ((32,), 2): 2.049})
    table = CostTable((SEQUENCE,), BATCHES, seconds)
    for scheduler in ("dp", "greedy", "single"):
        assert [(g.items, g.shape, g.batch) for g in batching.SCHEDULERS[scheduler]([(10,)], table)] == [((0,), (32,), 1)]
    assert table.cost((16,), 1) == 1.527
    assert [(g.shape, g.batch) for g in batching.dp([(10,), (12,)], table)] == [((16,), 2)]


def test_dp_keeps_a_short_request_out_of_a_long_batch():
    # a batch costs its padded tokens plus an overhead: one long request must not
    # drag short ones to 128, and the short ones share a batch
    table = CostTable((SEQUENCE,), BATCHES, {((s,), b): 10 + s * b for s in SEQUENCE for b in BATCHES})
    groups = batching.dp([(120,), (5,), (6,)], table)
    assert sorted((g.items, g.shape) for g in groups) == [((0,), (128,)), ((1, 2), (16,))]


@pytest.mark.parametrize("scheduler", sorted(batching.SCHEDULERS))
def test_a_length_above_the_largest_bucket_is_refused(scheduler):
    table = CostTable((SEQUENCE,), BATCHES, {((s,), b): 1.0 for s in SEQUENCE for b in BATCHES})
    with pytest.raises(ValueError, match="outside 1..128"):
        batching.SCHEDULERS[scheduler]([(3,), (129,)], table)


def test_a_table_with_a_missing_cell_is_refused():
    with pytest.raises(ValueError, match="no entry"):
        CostTable((SEQUENCE,), BATCHES, {((16,), 1): 1.0})
