"""Opara (Chen et al., IEEE TC 2025), Alg. 1 for streams and Alg. 2 for the launch order."""

from __future__ import annotations

from opara_core.planning import order as orders
from opara_core.planning.dag import Dag
from opara_core.planning.policies.lanes import StreamAssignment, check_budget, chains_from_links, fold_chains, renumber


def opara(dag: Dag, max_streams: int | None = None) -> StreamAssignment:
    """Alg. 1 exactly: a node joins the stream of its first predecessor whose sync flag is unset.

    Nodes are visited in node-list order and each node's predecessors in the order
    of their edges; a predecessor hands its stream to one consumer only (its flag is
    then set), and a node that finds no unflagged predecessor starts a new stream.
    Streams are never reused, as in the paper, unless there are more than
    `max_streams`: then the chains are folded onto that many lanes, reusing a lane
    whose work precedes a chain before sharing a busy one.
    """
    check_budget(max_streams)
    n = len(dag)
    flagged = [False] * n
    nxt: list[int | None] = [None] * n
    for v in range(n):
        for p in dag.preds[v]:
            if not flagged[p]:
                flagged[p] = True
                nxt[p] = v
                break
    chains = chains_from_links(n, nxt)
    if max_streams is None or len(chains) <= max_streams:
        stream = [0] * n
        for lane, chain in enumerate(chains):
            for v in chain:
                stream[v] = lane
    else:
        stream = fold_chains(dag, chains, range(n), max_streams)
    return StreamAssignment(stream=renumber(stream), order=orders.resource_aware(dag), order_name="opara")
