"""Plans as data: which stream each operator runs on, in which order, and where streams wait.

A `Plan` is what the GPU capture carries out and what the CLI prints. Waits are
derived the same way for every policy (`compute_waits`), so a policy only decides
lanes and a launch order. For traced models, `engine.interpreter.graph_schedule`
extends a plan over the kernel DAG to every node of the fx graph.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from opara_core.planning import order as orders
from opara_core.planning import policies
from opara_core.planning.dag import Dag

log = logging.getLogger(__name__)

# The keys of the CLI's DAG-file contract, in the order they are printed.
CONTRACT_KEYS = ("policy", "num_streams", "stream", "order", "waits")


@dataclass(frozen=True)
class Plan:
    """A schedule for one DAG.

    Launch the nodes in `order`, each on lane `stream[name]`; before launching a
    consumer, its lane waits on an event recorded after the producer, for every
    `(producer, consumer)` in `waits`. `priorities` has one CUDA stream priority per
    lane (lower is higher). `critical_path_us` is the longest cost-weighted path,
    the floor for any schedule; `sequential_us` the sum of all op costs (one
    stream); `estimated_us` is the plan's makespan when each lane runs its
    operators one after another and nothing else limits concurrency.
    """

    policy: str
    num_streams: int
    stream: Mapping[str, int]
    order: tuple[str, ...]
    waits: tuple[tuple[str, str], ...]
    priorities: tuple[int, ...] = ()
    launch_order: str = ""
    max_streams: int | None = None
    fingerprint: str = ""
    critical_path_us: float = 0.0
    sequential_us: float = 0.0
    estimated_us: float = 0.0
    free_ops: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stream", MappingProxyType(dict(self.stream)))
        object.__setattr__(self, "order", tuple(self.order))
        object.__setattr__(self, "waits", tuple((str(p), str(c)) for p, c in self.waits))
        object.__setattr__(self, "priorities", tuple(self.priorities) or (0,) * self.num_streams)

    def to_json(self) -> dict[str, Any]:
        """Every field, as plain JSON types; the first five keys are the CLI contract."""
        return {
            "policy": self.policy,
            "num_streams": self.num_streams,
            "stream": dict(self.stream),
            "order": list(self.order),
            "waits": [list(w) for w in self.waits],
            "priorities": list(self.priorities),
            "launch_order": self.launch_order,
            "max_streams": self.max_streams,
            "fingerprint": self.fingerprint,
            "critical_path_us": self.critical_path_us,
            "sequential_us": self.sequential_us,
            "estimated_us": self.estimated_us,
            "free_ops": self.free_ops,
        }

    def contract_json(self) -> dict[str, Any]:
        """Only the keys of the `plan --dag` output contract."""
        full = self.to_json()
        return {key: full[key] for key in CONTRACT_KEYS}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """Read `to_json()` output, or a contract-only plan (the rest gets defaults)."""
        try:
            return cls(
                policy=data["policy"],
                num_streams=int(data["num_streams"]),
                stream=data["stream"],
                order=tuple(data["order"]),
                waits=tuple(tuple(w) for w in data["waits"]),
                priorities=tuple(data.get("priorities", ())),
                launch_order=data.get("launch_order", ""),
                max_streams=data.get("max_streams"),
                fingerprint=data.get("fingerprint", ""),
                critical_path_us=float(data.get("critical_path_us", 0.0)),
                sequential_us=float(data.get("sequential_us", 0.0)),
                estimated_us=float(data.get("estimated_us", 0.0)),
                free_ops=int(data.get("free_ops", 0)),
            )
        except KeyError as e:
            raise ValueError(f"a plan needs the key {e.args[0]!r}") from None

    def check(self, dag: Dag) -> None:
        """Raise ValueError unless this plan enforces every edge of `dag` (see `violations`)."""
        problems = violations(dag, self)
        if problems:
            raise ValueError(f"invalid plan: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))

    def summary(self) -> str:
        """A few lines for people: ops, free ops, streams, waits, critical path, estimate."""
        high = sum(1 for p in self.priorities if p < 0)
        budget = "no budget" if self.max_streams is None else f"budget {self.max_streams}"
        speedup = self.sequential_us / self.estimated_us if self.estimated_us else 0.0
        lines = [
            f"policy          {self.policy} (launch order: {self.launch_order or 'given'}, {budget})",
            f"ops             {len(self.order)} kernels, {self.free_ops} free",
            f"streams         {self.num_streams} ({high} high priority)",
            f"waits           {len(self.waits)}",
            f"critical path   {self.critical_path_us:.1f} us (estimated op costs on the longest path; the floor)",
            f"estimated time  {self.estimated_us:.1f} us (lanes serial, no other contention; "
            f"one stream: {self.sequential_us:.1f} us, {speedup:.2f}x)",
        ]
        if self.fingerprint:
            lines.append(f"fingerprint     {self.fingerprint}")
        return "\n".join(lines)


def make_plan(
    dag: Dag,
    policy: str,
    max_streams: int | None = None,
    order: str | None = None,
    fingerprint: str | None = None,
    free_ops: int = 0,
) -> Plan:
    """Plan `dag` with the policy called `policy`.

    `order` names a launch order from `opara_core.planning.order.ORDERS`; None keeps the
    policy's own (Alg. 2 for opara, critical-path first for asap, waves for
    wavefront, topological otherwise). The lanes do not depend on it.
    """
    assignment = policies.get(policy)(dag, max_streams)
    launch = assignment.order if order is None else orders.launch_order(dag, order)
    stream = assignment.stream
    waits = compute_waits(dag, stream, launch)
    names = dag.names
    plan = Plan(
        policy=policy,
        num_streams=assignment.num_streams,
        stream={names[v]: stream[v] for v in range(len(dag))},
        order=tuple(names[v] for v in launch),
        waits=tuple((names[p], names[c]) for p, c in waits),
        priorities=orders.lane_priorities(dag, stream),
        launch_order=order or assignment.order_name,
        max_streams=max_streams,
        fingerprint=dag.fingerprint() if fingerprint is None else fingerprint,
        critical_path_us=dag.critical_path_us,
        sequential_us=sum(dag.costs),
        estimated_us=estimate_makespan(dag, stream, launch),
        free_ops=free_ops,
    )
    log.debug("planned %d ops with %s: %d streams, %d waits", len(dag), policy, plan.num_streams, len(waits))
    return plan


def compute_waits(dag: Dag, stream: Sequence[int], order: Sequence[int]) -> list[tuple[int, int]]:
    """The waits (producer, consumer) that enforce every edge, none redundant.

    A vector-clock pass in launch order: `clock[s][t]` is how many operators of lane
    t lane s is known to run after. A consumer waits on a producer only when its
    lane does not already run after it; taking a node's predecessors from the last
    launched to the first, one wait on a late producer covers everything that
    producer itself waited on. Each wait is therefore needed, transitively implied
    edges get none, and when lanes are chains this is |E_tr| - |matching|.
    """
    lanes = max(stream, default=-1) + 1
    pos = [0] * len(dag)
    for i, v in enumerate(order):
        pos[v] = i
    count = [0] * lanes
    seq = [0] * len(dag)
    clock = [[0] * lanes for _ in range(lanes)]
    after: list[list[int]] = [[]] * len(dag)
    waits = []
    for v in order:
        lane = stream[v]
        mine = clock[lane]
        for p in sorted(dag.preds[v], key=pos.__getitem__, reverse=True):
            if mine[stream[p]] < seq[p]:
                waits.append((p, v))
                mine[:] = map(max, mine, after[p])
        count[lane] += 1
        seq[v] = mine[lane] = count[lane]
        after[v] = mine.copy()
    return waits


def violations(dag: Dag, plan: Plan) -> list[str]:
    """Everything wrong with `plan` as a schedule of `dag`; empty when it is valid.

    Independent of `compute_waits`: builds the happens-before relation from
    same-lane launch order plus waits and checks every DAG edge against it.
    """
    index = dag.index
    problems = []
    if sorted(plan.order) != sorted(dag.names) or set(plan.stream) != set(dag.names):
        return ["order and stream must name every node exactly once"]
    lanes = sorted(set(plan.stream.values()))
    if lanes != list(range(plan.num_streams)):
        problems.append(f"stream ids are {lanes[:5]}..., not 0..{plan.num_streams - 1}")
    pos = {name: i for i, name in enumerate(plan.order)}
    for u, v in dag.edges:
        if pos[u] > pos[v]:
            problems.append(f"order launches {v!r} before its input {u!r}")
    incoming: dict[str, list[str]] = {name: [] for name in plan.order}
    last_on_lane: dict[int, str] = {}
    for name in plan.order:
        lane = plan.stream[name]
        if lane in last_on_lane:
            incoming[name].append(last_on_lane[lane])
        last_on_lane[lane] = name
    for p, c in plan.waits:
        if p not in index or c not in index:
            problems.append(f"wait [{p!r}, {c!r}] names an unknown node")
            continue
        if plan.stream[p] == plan.stream[c]:
            problems.append(f"wait [{p!r}, {c!r}] joins stream {plan.stream[p]} to itself")
        if pos[p] > pos[c]:
            problems.append(f"wait [{p!r}, {c!r}] waits on an event recorded later")
        incoming[c].append(p)
    before: dict[str, int] = {}
    for name in plan.order:
        bits = 0
        for p in incoming[name]:
            bits |= before.get(p, 0) | (1 << index[p])
        before[name] = bits
    for u, v in dag.edges:
        if not before[v] >> index[u] & 1:
            problems.append(f"edge {u!r} -> {v!r} is not enforced")
    return problems


def estimate_makespan(dag: Dag, stream: Sequence[int], order: Sequence[int]) -> float:
    """Finish time of the last op when lanes run serially and edges are the only other limit."""
    cost = dag.costs
    finish = [0.0] * len(dag)
    lane_free = [0.0] * (max(stream, default=-1) + 1)
    for v in order:
        start = max([lane_free[stream[v]], *(finish[p] for p in dag.preds[v])])
        finish[v] = lane_free[stream[v]] = start + cost[v]
    return max(finish, default=0.0)
