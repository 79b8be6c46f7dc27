"""Cut a plan into segments: runs of operators on one lane that can be compiled as one piece.

Fused lanes compile each segment with a kernel generator (Inductor), which fuses
the operators inside it, while the segments themselves keep the plan's lanes and
run concurrently. A segment may only be waited on at its end and may only wait at
its start, so that the compiled piece needs no event inside it:

- a node that has a producer on another lane starts a new segment (its wait
  becomes the segment's wait);
- a node that has a consumer on another lane ends its segment (its event becomes
  the segment's event).

The segments of one lane follow the lane's launch order, and a cross-lane edge
always runs from the last node of one segment to the first node of another, so
launching each segment whole at the position of its first node keeps every edge
of the DAG: the result is an ordinary `Plan` over the segment DAG, with waits
from `compute_waits`, that the engine captures like any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from opara_core.planning.dag import Dag, OpNode
from opara_core.planning.plan import Plan, compute_waits, estimate_makespan


@dataclass(frozen=True)
class Segmentation:
    """A plan cut into segments.

    `members[s]` are the operator names of segment `s` in launch order; `of` maps
    each operator to its segment's name; `dag` is the segment DAG (costs summed,
    edges between segments) and `plan` the segment-level plan (same lanes).
    """

    members: Mapping[str, tuple[str, ...]]
    of: Mapping[str, str]
    dag: Dag
    plan: Plan

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", MappingProxyType(dict(self.members)))
        object.__setattr__(self, "of", MappingProxyType(dict(self.of)))


def segment_plan(dag: Dag, plan: Plan, prefix: str = "segment") -> Segmentation:
    """Cut `plan` (a valid plan of `dag`) into segments; see the module docstring."""
    index = dag.index
    lane = [plan.stream[name] for name in dag.names]
    crossing_in = [any(lane[p] != lane[v] for p in dag.preds[v]) for v in range(len(dag))]
    crossing_out = [any(lane[s] != lane[v] for s in dag.succs[v]) for v in range(len(dag))]
    open_segment: dict[int, list[int]] = {}  # lane -> the segment being filled there
    segments: list[list[int]] = []
    for name in plan.order:
        v = index[name]
        current = open_segment.get(lane[v])
        if current is None or crossing_in[v]:
            current = []
            segments.append(current)
            open_segment[lane[v]] = current
        current.append(v)
        if crossing_out[v]:
            del open_segment[lane[v]]
    names = [f"{prefix}{i}" for i in range(len(segments))]
    seg_of = [0] * len(dag)
    for s, members in enumerate(segments):
        for v in members:
            seg_of[v] = s
    edges = sorted({(seg_of[u], seg_of[v]) for u, v in dag.index_edges if seg_of[u] != seg_of[v]})
    nodes = tuple(
        OpNode(
            name=names[s],
            kind="compute" if any(dag.nodes[v].kind == "compute" for v in members) else "memory",
            cost=sum(dag.nodes[v].cost for v in members),
            flops=sum(dag.nodes[v].flops for v in members),
            bytes=sum(dag.nodes[v].bytes for v in members),
        )
        for s, members in enumerate(segments)
    )
    segment_dag = Dag(nodes, tuple((names[u], names[v]) for u, v in edges))
    stream = [lane[members[0]] for members in segments]
    launch = list(range(len(segments)))  # segments were opened in launch order
    waits = compute_waits(segment_dag, stream, launch)
    segment_plan_ = Plan(
        policy=plan.policy,
        num_streams=plan.num_streams,
        stream={names[s]: stream[s] for s in launch},
        order=tuple(names),
        waits=tuple((names[p], names[c]) for p, c in waits),
        priorities=plan.priorities,
        launch_order=plan.launch_order,
        max_streams=plan.max_streams,
        fingerprint=plan.fingerprint,
        critical_path_us=segment_dag.critical_path_us,
        sequential_us=sum(segment_dag.costs),
        estimated_us=estimate_makespan(segment_dag, stream, launch),
        free_ops=plan.free_ops,
    )
    return Segmentation(
        members={names[s]: tuple(dag.names[v] for v in members) for s, members in enumerate(segments)},
        of={dag.names[v]: names[seg_of[v]] for v in range(len(dag))},
        dag=segment_dag,
        plan=segment_plan_,
    )
