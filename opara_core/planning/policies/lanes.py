"""What the policies share: the answer's type, and chains folded onto a bounded set of lanes.

The chain policies (opara, nimble, asap, wavefront) first cut the DAG into chains
(paths whose consecutive operators can run back to back on one stream without an
event) and then decide which lane (CUDA stream) each chain runs on. Lanes are
reused, never aliased: a chain goes to a lane whose last operator is an ancestor
of the chain's head (no false dependency), a new lane is opened while the budget
allows, and only past the budget does a chain share a lane that is still busy,
the one expected to free first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from opara_core.planning.dag import Dag


@dataclass(frozen=True)
class StreamAssignment:
    """A policy's answer: a lane per node (by node index) and its launch order.

    Lanes are numbered 0..num_streams-1 without gaps, in the order in which they
    first appear in the DAG's node list. `order` is the policy's own launch order
    (node indices, topological), called `order_name`; any other topological order
    is also valid.
    """

    stream: tuple[int, ...]
    order: tuple[int, ...]
    order_name: str = "topological"

    @property
    def num_streams(self) -> int:
        return max(self.stream, default=-1) + 1


def check_budget(max_streams: int | None) -> None:
    if max_streams is not None and (isinstance(max_streams, bool) or not isinstance(max_streams, int) or max_streams < 1):
        raise ValueError(f"max_streams must be an integer >= 1, got {max_streams!r}")


def chains_from_links(n: int, nxt: Sequence[int | None]) -> list[list[int]]:
    """Chains from successor links (nxt[i] is the next node on i's chain), by head index."""
    has_prev = [False] * n
    for i in range(n):
        if nxt[i] is not None:
            has_prev[nxt[i]] = True
    chains = []
    for head in range(n):
        if has_prev[head]:
            continue
        chain = [head]
        while nxt[chain[-1]] is not None:
            chain.append(nxt[chain[-1]])
        chains.append(chain)
    return chains


def fold_chains(
    dag: Dag,
    chains: Sequence[Sequence[int]],
    order: Sequence[int],
    max_streams: int | None,
) -> list[int]:
    """Put each chain on a lane, visiting chains by the launch position of their head.

    A lane whose last operator precedes the head in the DAG is taken
    first (preferring one whose last operator feeds the head, which saves an event,
    then the most recently used one); otherwise a new lane is opened while fewer than
    `max_streams` exist; otherwise the chain shares the lane whose last operator is
    expected to finish first. Returns the (not yet renumbered) lane of every node.
    """
    check_budget(max_streams)
    pos = [0] * len(dag)
    for i, v in enumerate(order):
        pos[v] = i
    finish = [t + c for t, c in zip(dag.top_levels, dag.costs)]
    desc = dag.descendants
    stream = [-1] * len(dag)
    last: list[int] = []  # per lane: its operator launched last so far
    for chain in sorted(chains, key=lambda c: pos[c[0]]):
        head = chain[0]
        free = [lane for lane, tail in enumerate(last) if desc[tail] >> head & 1]
        if free:
            preds = dag.preds[head]
            lane = max(free, key=lambda lane: (last[lane] in preds, pos[last[lane]], -lane))
        elif max_streams is None or len(last) < max_streams:
            lane = len(last)
            last.append(head)
        else:
            lane = min(range(len(last)), key=lambda lane: (finish[last[lane]], lane))
        for v in chain:
            stream[v] = lane
        if pos[chain[-1]] > pos[last[lane]]:
            last[lane] = chain[-1]
    return stream


def renumber(stream: Sequence[int]) -> tuple[int, ...]:
    """Lane ids 0..k-1 without gaps, numbered by first appearance in node order."""
    ids: dict[int, int] = {}
    return tuple(ids.setdefault(s, len(ids)) for s in stream)
