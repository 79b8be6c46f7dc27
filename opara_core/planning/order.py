"""Launch orders and lane priorities.

A launch order is a topological order of the DAG's nodes (by index): the order in
which operators are enqueued during capture. Any topological order is correct for
any stream assignment (the waits are derived from it); the order only changes which
of several ready operators the GPU is handed first. All orders are Kahn's algorithm
with a different choice among ready nodes, and every tie goes to the lower index so
that the result is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from opara_core.planning.dag import Dag, OpNode

# Per-block limits used to turn resources into fractions (H100; compute capability 9.0).
MAX_THREADS_PER_BLOCK = 1024
REGISTERS_PER_BLOCK = 65536
SHARED_MEMORY_PER_BLOCK = 48 * 1024  # the default limit, as Opara normalises it


def resource_demand(node: OpNode) -> float:
    """Mean fraction of a block's threads, registers and shared memory that the kernel uses.

    Only the known resources count; without a GPU profile there are none and the
    demand is 0, so the static cost decides instead (see `opara`).
    """
    fractions = []
    if node.threads is not None:
        fractions.append(node.threads / MAX_THREADS_PER_BLOCK)
        if node.registers is not None:
            fractions.append(node.registers * node.threads / REGISTERS_PER_BLOCK)
    if node.shared_memory is not None:
        fractions.append(node.shared_memory / SHARED_MEMORY_PER_BLOCK)
    return sum(fractions) / len(fractions) if fractions else 0.0


def topological(dag: Dag) -> tuple[int, ...]:
    """The node list itself, which is a topological order by construction."""
    return tuple(range(len(dag)))


def resource_aware(dag: Dag) -> tuple[int, ...]:
    """Opara's Alg. 2: alternate compute- and memory-bound ready operators, least demand first.

    Two ready lists; a flag flips on every step and picks the list when both are
    non-empty (compute first), otherwise the non-empty one is used. From the chosen
    list the operator with the least resource demand is launched (ties: the cheaper
    operator, then the lower index), so that it leaves room on the SMs for the
    operators launched next to it.
    """
    key = [(resource_demand(n), n.cost, i) for i, n in enumerate(dag.nodes)]
    pending = [len(p) for p in dag.preds]
    ready: dict[str, list[tuple[float, float, int]]] = {"compute": [], "memory": []}
    for i, n in enumerate(dag.nodes):
        if not pending[i]:
            heapq.heappush(ready[n.kind], key[i])
    order = []
    compute_turn = True
    while ready["compute"] or ready["memory"]:
        if ready["compute"] and ready["memory"]:
            heap = ready["compute"] if compute_turn else ready["memory"]
        else:
            heap = ready["compute"] or ready["memory"]
        compute_turn = not compute_turn
        v = heapq.heappop(heap)[2]
        order.append(v)
        for s in dag.succs[v]:
            pending[s] -= 1
            if not pending[s]:
                heapq.heappush(ready[dag.nodes[s].kind], key[s])
    return tuple(order)


def critical_path(dag: Dag) -> tuple[int, ...]:
    """Critical-path first: among ready operators, the longest remaining path goes first."""
    return _list_order(dag, [(-b, i) for i, b in enumerate(dag.bottom_levels)])


def _list_order(dag: Dag, key: Sequence[tuple]) -> tuple[int, ...]:
    pending = [len(p) for p in dag.preds]
    ready = [key[i] for i in range(len(dag)) if not pending[i]]
    heapq.heapify(ready)
    order = []
    while ready:
        v = heapq.heappop(ready)[-1]
        order.append(v)
        for s in dag.succs[v]:
            pending[s] -= 1
            if not pending[s]:
                heapq.heappush(ready, key[s])
    return tuple(order)


ORDERS: dict[str, Callable[[Dag], tuple[int, ...]]] = {
    "topological": topological,
    "opara": resource_aware,  # the name plans and the CLI use for Alg. 2
    "critical_path": critical_path,
}


def launch_order(dag: Dag, name: str) -> tuple[int, ...]:
    """The launch order called `name` (one of ORDERS)."""
    try:
        return ORDERS[name](dag)
    except KeyError:
        raise ValueError(f"unknown launch order {name!r}; known orders: {', '.join(ORDERS)}") from None


HIGH_PRIORITY = -1  # CUDA convention: a lower number is a higher priority
NORMAL_PRIORITY = 0


def lane_priorities(dag: Dag, stream: Sequence[int]) -> tuple[int, ...]:
    """A priority per lane: high for the lanes that carry the critical path, normal otherwise.

    Stream priority survives into graph replay (PyTorch instantiates graphs with
    node priorities), unlike the host launch order, so it is how the plan says
    which work must not wait behind the rest.
    """
    num = max(stream, default=-1) + 1
    critical = {stream[v] for v in dag.critical_path}
    return tuple(HIGH_PRIORITY if lane in critical else NORMAL_PRIORITY for lane in range(num))
