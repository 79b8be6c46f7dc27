"""Split one batch of variable-length requests into padded sub-batches.

TurboTransformers' batch scheduler (PPoPP 2021, "Algorithm 2: Batch Scheduler
With DP"): sort the requests by length; `states[i]` is the least cost of serving
the first i of them; `states[i] = min over j < i of states[j] + cost(group j..i)`,
where a group runs as one batch padded to the sequence bucket of its longest
request, at the batch bucket of its size, and costs what that (sequence, batch)
runner was measured to take. Back-tracking the split points gives the groups.

A group may run on any cell of the table that holds it: a longer shape (padded
further) or a larger batch bucket (padded with empty rows), when that cell was
measured faster (on an H100, BERT's 16-token batch-1 graph took 1.94 ms and its
32-token one 1.53). So a group costs the cheapest cell at or above its own, and
runs there: costs that never fall as a cell grows, whatever was measured.

A length is a tuple, one entry per variable axis (BERT: the sequence; T5: the
encoder and the decoder), and a shape bucket is one sequence bucket per axis.
With one axis, the best split of the sorted order is then the best of all
partitions (a group of the same size made of shorter requests never costs
more); with two axes the groups are contiguous runs of the lexicographic
order, the algorithm as published.

Also the baselines a benchmark compares it with: group by bucket (greedy),
pad everything to the largest bucket, and every request alone.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

Length = tuple[int, ...]  # one length per variable axis
Shape = tuple[int, ...]  # one sequence bucket per variable axis


@dataclass(frozen=True)
class Group:
    """One sub-batch: the requests it holds (indices into the scheduled list),
    the sequence buckets they are padded to, and the batch bucket it runs at
    (the table's cheapest cell that holds them)."""

    items: tuple[int, ...]
    shape: Shape
    batch: int


@dataclass(frozen=True)
class CostTable:
    """Seconds (or any cost unit) of one run of each (shape, batch bucket).

    `axes` holds each axis's sequence buckets, ascending; `batches` the batch
    buckets, ascending; `seconds[(shape, batch)]` is defined for every shape of
    the grid and every batch bucket.
    """

    axes: tuple[tuple[int, ...], ...]
    batches: tuple[int, ...]
    seconds: Mapping[tuple[Shape, int], float]

    def __post_init__(self) -> None:
        for buckets in (*self.axes, self.batches):
            if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
                raise ValueError(f"buckets must be ascending positive integers, got {list(buckets)}")
        missing = [(s, b) for s in self.shapes() for b in self.batches if (s, b) not in self.seconds]
        if missing:
            raise ValueError(f"the cost table has no entry for {len(missing)} cells, e.g. shape {missing[0][0]} batch {missing[0][1]}")

    @property
    def max_batch(self) -> int:
        return self.batches[-1]

    @property
    def limits(self) -> Length:
        """The longest length each axis accepts."""
        return tuple(buckets[-1] for buckets in self.axes)

    def shapes(self) -> list[Shape]:
        """Every shape of the grid, smallest first."""
        return grid(self.axes)

    def shape_for(self, length: Length) -> Shape:
        """The smallest shape that holds `length` on every axis."""
        if len(length) != len(self.axes):
            raise ValueError(f"length {length} has {len(length)} axes, the table {len(self.axes)}")
        return tuple(_bucket(n, buckets) for n, buckets in zip(length, self.axes))

    def batch_for(self, rows: int) -> int:
        """The smallest batch bucket that holds `rows`."""
        return _bucket(rows, self.batches)

    @cached_property
    def cheapest(self) -> dict[tuple[Shape, int], tuple[Shape, int]]:
        """For every cell, the cheapest cell that holds what it holds: a shape at
        least as long on every axis, a batch bucket at least as large (ties: the
        smaller cell)."""
        cells = sorted(self.seconds, key=lambda cell: (self.seconds[cell], cell))
        return {
            (shape, batch): next(c for c in cells if c[1] >= batch and all(n >= m for n, m in zip(c[0], shape)))
            for shape in self.shapes()
            for batch in self.batches
        }

    @cached_property
    def batch_of(self) -> tuple[int, ...]:
        """`batch_of[rows]`: the batch bucket of 1..max_batch rows (0 at 0)."""
        return (0, *(self.batch_for(rows) for rows in range(1, self.max_batch + 1)))

    @cached_property
    def least(self) -> dict[tuple[Shape, int], float]:
        """Every cell's cost: that of the cheapest cell that holds it."""
        return {cell: self.seconds[best] for cell, best in self.cheapest.items()}

    def cost(self, shape: Shape, rows: int) -> float:
        """Seconds of `rows` requests padded to `shape`, on the cheapest cell that holds them."""
        return self.least[(shape, self.batch_for(rows))]


def grid(axes: Sequence[Sequence[int]]) -> list[Shape]:
    """Every shape of the buckets `axes` (one list per axis), smallest first."""
    return [tuple(shape) for shape in itertools.product(*axes)]


def _bucket(n: int, buckets: Sequence[int]) -> int:
    index = bisect.bisect_left(buckets, n)
    if n < 1 or index == len(buckets):
        raise ValueError(f"{n} is outside 1..{buckets[-1]}")
    return buckets[index]


def _group(items: Sequence[int], lengths: Sequence[Length], table: CostTable, shape: Shape | None = None) -> Group:
    if shape is None:
        shape = table.shape_for(tuple(max(axis) for axis in zip(*(lengths[i] for i in items))))
    return Group(tuple(items), *table.cheapest[(shape, table.batch_for(len(items)))])


def _sorted(lengths: Sequence[Length]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (lengths[i], i))


def dp(lengths: Sequence[Length], table: CostTable) -> list[Group]:
    """Turbo's scheduler: the cheapest split of the length-sorted requests into
    runs of at most `table.max_batch`; O(n * max_batch * axes)."""
    order = _sorted(lengths)
    n = len(order)
    # the inner loop runs n * max_batch times inside `execute`: plain lookups only
    # (the bucket of the longest is the largest bucket, axis by axis)
    shapes = [table.shape_for(lengths[i]) for i in order]
    batch_of = table.batch_of
    seconds = table.least
    states = [0.0] + [float("inf")] * n
    split = [0] * (n + 1)
    for end in range(1, n + 1):
        shape = shapes[end - 1]
        for start in range(end - 1, max(end - table.max_batch, 0) - 1, -1):
            if shapes[start] != shape:
                shape = tuple(map(max, shape, shapes[start]))
            total = states[start] + seconds[(shape, batch_of[end - start])]
            if total < states[end]:
                states[end], split[end] = total, start
    groups = []
    end = n
    while end:
        groups.append(_group(order[split[end] : end], lengths, table))
        end = split[end]
    return groups[::-1]


def greedy(lengths: Sequence[Length], table: CostTable) -> list[Group]:
    """Requests of one shape bucket together, in runs of at most `max_batch`."""
    by_shape: dict[Shape, list[int]] = {}
    for i in _sorted(lengths):
        by_shape.setdefault(table.shape_for(lengths[i]), []).append(i)
    return [
        _group(items[k : k + table.max_batch], lengths, table, shape)
        for shape, items in sorted(by_shape.items())
        for k in range(0, len(items), table.max_batch)
    ]


def padded(lengths: Sequence[Length], table: CostTable) -> list[Group]:
    """Every request padded to the largest bucket of each axis (what serving a
    fixed length does), in arrival order, in runs of at most `max_batch`."""
    for length in lengths:
        table.shape_for(length)  # refuses a length above the limits
    items = range(len(lengths))
    return [_group(items[k : k + table.max_batch], lengths, table, table.limits) for k in range(0, len(lengths), table.max_batch)]


def single(lengths: Sequence[Length], table: CostTable) -> list[Group]:
    """Every request alone (at its own bucket, or a cheaper cell): no batching at all."""
    return [_group((i,), lengths, table) for i in range(len(lengths))]


SCHEDULERS: dict[str, Callable[[Sequence[Length], CostTable], list[Group]]] = {
    "dp": dp,
    "greedy": greedy,
    "padded": padded,
    "single": single,
}


def total_cost(groups: Sequence[Group], table: CostTable) -> float:
    """What running `groups` costs by the table."""
    return sum(table.seconds[(g.shape, g.batch)] for g in groups)
