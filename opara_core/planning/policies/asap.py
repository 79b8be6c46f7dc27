"""RAF's ASAP stream schedule: heavy chains along the critical path, lanes reused."""

from __future__ import annotations

from opara_core.planning import order as orders
from opara_core.planning.dag import Dag
from opara_core.planning.policies.lanes import StreamAssignment, check_budget, chains_from_links, fold_chains, renumber


def asap(dag: Dag, max_streams: int | None = None) -> StreamAssignment:
    """Heavy chains on the transitive reduction, launched critical-path first.

    Nodes are visited by decreasing remaining path (cost-weighted depth); each takes
    as its heavy input the unclaimed reduction predecessor that finishes last (the
    one on its critical path; ties: edge order), so the critical path becomes one
    chain. A chain goes to a lane whose last operator precedes its head (RAF's
    stream reuse), else to a new lane within `max_streams`, else to the lane that
    frees first. Only the other (light) edges need events.
    """
    check_budget(max_streams)
    n = len(dag)
    finish = [t + c for t, c in zip(dag.top_levels, dag.costs)]
    bottom = dag.bottom_levels
    heavy_user: list[int | None] = [None] * n
    for v in sorted(range(n), key=lambda v: (-bottom[v], v)):
        best = None
        for p in dag.reduced_preds[v]:
            if heavy_user[p] is None and (best is None or finish[p] > finish[best]):
                best = p
        if best is not None:
            heavy_user[best] = v
    launch = orders.critical_path(dag)
    stream = fold_chains(dag, chains_from_links(n, heavy_user), launch, max_streams)
    return StreamAssignment(stream=renumber(stream), order=launch, order_name="critical_path")
