"""Helpers shared by the scheduling-engine tests (not a test module).

Tracing a zoo model takes seconds to minutes, so each model is traced at most once
per test session, whichever test asks first.
"""

from __future__ import annotations

import functools
import itertools

from hypothesis import strategies as st

from opara_core.planning.dag import KINDS, Dag, OpNode
from opara_core.planning.plan import Plan, violations

# The example of the Opara paper's appendix: 13 operators, 5 streams under Alg. 1.
APPENDIX_EDGES = [
    (1, 2), (1, 3), (1, 4), (2, 5), (3, 6), (4, 7), (5, 8), (6, 8), (7, 8),
    (8, 9), (8, 10), (9, 11), (9, 12), (10, 13), (11, 13), (12, 13),
]  # fmt: skip


def appendix_dag() -> Dag:
    return Dag(tuple(OpNode(str(i)) for i in range(1, 14)), tuple((str(a), str(b)) for a, b in APPENDIX_EDGES))


@functools.lru_cache(maxsize=None)
def traced(name: str):
    """The zoo model `name`, traced once per session (batch 1 costs)."""
    from opara_core import zoo
    from opara_core.engine.trace import trace_model

    entry = zoo.get(name)
    return trace_model(entry, entry.build())


@st.composite
def dags(draw, max_nodes: int = 12, resources: bool = True) -> Dag:
    """Random DAGs: nodes in index order, edges only forward, random kinds and costs."""
    n = draw(st.integers(1, max_nodes))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))
    edges = [(f"op{min(a, b)}", f"op{max(a, b)}") for a, b in pairs if a != b]
    nodes = []
    for i in range(n):
        threads = draw(st.sampled_from([None, 64, 128, 256, 1024])) if resources else None
        nodes.append(
            OpNode(
                name=f"op{i}",
                kind=draw(st.sampled_from(KINDS)),
                cost=float(draw(st.integers(1, 50))),
                threads=threads,
                shared_memory=draw(st.sampled_from([None, 0, 4096, 49152])) if resources else None,
            )
        )
    return Dag(tuple(nodes), tuple(edges))


def redundant_waits(dag: Dag, plan: Plan) -> list[tuple[str, str]]:
    """Waits whose removal still leaves a valid plan."""
    out = []
    for i, wait in enumerate(plan.waits):
        fewer = Plan(
            policy=plan.policy,
            num_streams=plan.num_streams,
            stream=plan.stream,
            order=plan.order,
            waits=plan.waits[:i] + plan.waits[i + 1 :],
        )
        if not violations(dag, fewer):
            out.append(wait)
    return out


def reach_by_brute_force(dag: Dag) -> list[list[bool]]:
    """reach[u][v]: a path u -> v, by Floyd-Warshall closure of the edges."""
    n = len(dag)
    reach = [[False] * n for _ in range(n)]
    for u, v in dag.index_edges:
        reach[u][v] = True
    for w, u, v in itertools.product(range(n), repeat=3):
        if reach[u][w] and reach[w][v]:
            reach[u][v] = True
    return reach


def reduction_by_brute_force(dag: Dag) -> list[tuple[int, int]]:
    """Edges (u, v) with no other path u -> w -> v."""
    reach = reach_by_brute_force(dag)
    return sorted(
        (u, v)
        for u, v in set(dag.index_edges)
        if not any(reach[u][w] and reach[w][v] for w in range(len(dag)) if w not in (u, v))
    )


def min_waits_by_brute_force(dag: Dag) -> int:
    """The fewest waits when every stream is a chain: over all partitions into chains
    (blocks whose nodes are pairwise connected by a path), the fewest reduction edges
    between different blocks."""
    reach = reach_by_brute_force(dag)
    tr = reduction_by_brute_force(dag)
    best = len(tr)
    for blocks in _partitions(list(range(len(dag)))):
        if all(reach[u][v] or reach[v][u] for block in blocks for u, v in itertools.combinations(block, 2)):
            block_of = {v: b for b, block in enumerate(blocks) for v in block}
            best = min(best, sum(1 for u, v in tr if block_of[u] != block_of[v]))
    return best


def _partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first, *part[i]]] + part[i + 1 :]
        yield [[first], *part]
