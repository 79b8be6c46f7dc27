"""Side lanes: the critical path on one lane, only large independent branches beside it.

For fused lanes every lane boundary cuts an Inductor segment, and each cut costs a
launch and the fusions across it. Opara's chains cut a transformer into hundreds of
segments (T5-small: 617 fused operators into 237 segments) to gain overlap of a few
per cent. This policy cuts only where a branch off the critical path is big enough
to pay for it.
"""

from __future__ import annotations

import networkx as nx

from opara_core.planning import order as orders
from opara_core.planning.dag import Dag
from opara_core.planning.policies.lanes import StreamAssignment, check_budget, renumber

# A branch off the critical path gets a lane of its own from this share of the
# DAG's total cost (T5-small: its decoder's embedding and first self-attention,
# 6.4%; the next branches are each under 1%).
SIDE_SHARE = 0.05


def side(dag: Dag, max_streams: int | None = None) -> StreamAssignment:
    """Lane 0: the critical path and everything small; lanes 1..: the heavy branches.

    Off-path nodes are grouped into the weakly connected components of the off-path
    subgraph. A node that feeds the path at more than one place (a bias every layer
    reads) stays on lane 0 with its off-path ancestors, so no side lane holds up the
    path twice. A remaining component with at least SIDE_SHARE of the total cost goes,
    heaviest first, to the least loaded of the `max_streams - 1` side lanes; the rest
    stay on lane 0. Launch order: critical path first.
    """
    check_budget(max_streams)
    n = len(dag)
    on_path = set(dag.critical_path)
    pinned: set[int] = set()
    for v in range(n):
        if v not in on_path and sum(s in on_path for s in dag.succs[v]) > 1:
            pinned.add(v)
    for v in range(n - 1, -1, -1):  # off-path ancestors of pinned nodes (node list is topological)
        if v in pinned:
            pinned.update(p for p in dag.preds[v] if p not in on_path)
    free = [v for v in range(n) if v not in on_path and v not in pinned]
    graph = nx.Graph()
    graph.add_nodes_from(free)
    graph.add_edges_from((u, v) for u, v in dag.index_edges if u in graph and v in graph)
    total = sum(dag.costs) or 1.0
    costed = ((sum(dag.costs[v] for v in c), min(c), c) for c in nx.connected_components(graph))
    branches = sorted((-cost, first, c) for cost, first, c in costed if cost >= SIDE_SHARE * total)  # heaviest first
    side_lanes = len(branches) if max_streams is None else max_streams - 1
    stream = [0] * n
    if side_lanes > 0:
        load = [0.0] * side_lanes
        for negative_cost, _, branch in branches:
            lane = min(range(side_lanes), key=lambda lane: (load[lane], lane))
            load[lane] -= negative_cost
            for v in branch:
                stream[v] = lane + 1
    return StreamAssignment(stream=renumber(stream), order=orders.critical_path(dag), order_name="critical_path")
