"""Plans over traced graphs, and the interpreter that runs them node by node.

`plan_graph` plans a traced model's kernel DAG; `graph_schedule` extends the plan
to every fx node. `PlanInterpreter` runs the plan's order (on the CPU it is the
oracle for plans; capture subclasses it to put each node on its lane's stream).

The oracle for plans without a GPU: if a plan's order ever ran an operator before
its inputs (or dropped one), the outputs would differ from eager or the run would
fail. Streams do not exist on the CPU; the lane of each node is recorded with it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from opara_core.engine.trace import OpGraph
from opara_core.planning.plan import Plan, make_plan


class PlanInterpreter(torch.fx.Interpreter):
    """An fx Interpreter over a copy of the graph whose node list is the plan's full order.

    `run_node` is the one hook overridden: it records (node name, lane) in
    `executed`, so tests can check that what ran is what was planned.
    """

    def __init__(self, graph: OpGraph, plan: Plan) -> None:
        self.schedule: GraphSchedule = graph_schedule(plan, graph)
        super().__init__(graph.module, graph=reordered_graph(graph.module.graph, self.schedule.order))
        self.executed: list[tuple[str, int]] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        self.executed.append((n.name, self.schedule.stream[n.name]))
        return super().run_node(n)


def run_plan(graph: OpGraph, plan: Plan, *inputs: Any) -> Any:
    """The model's outputs for `inputs`, computed node by node in `plan`'s order."""
    with torch.no_grad():
        return PlanInterpreter(graph, plan).run(*inputs)


def reordered_graph(graph: torch.fx.Graph, order: tuple[str, ...]) -> torch.fx.Graph:
    """A copy of `graph` with its nodes in `order` (same names, same input/output handling)."""
    by_name = {node.name: node for node in graph.nodes}
    copy = torch.fx.Graph(owning_module=graph.owning_module)
    copy.set_codegen(graph._codegen)  # the same pytree handling of inputs and outputs
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for name in order:
        node = by_name[name]
        env[node] = copy.node_copy(node, env.__getitem__)
    return copy


@dataclass(frozen=True)
class GraphSchedule:
    """A plan extended to every fx node: a lane for each and one order for all.

    Free nodes (no kernel) take the lane of their first input's producer
    (placeholders and get_attr: lane 0) and come right after their inputs.
    """

    stream: Mapping[str, int]
    order: tuple[str, ...]


def plan_graph(graph: OpGraph, policy: str, max_streams: int | None = None, order: str | None = None) -> Plan:
    """Plan a traced model's kernel DAG; the plan carries the model's fingerprint."""
    free = sum(1 for n in graph.module.graph.nodes if n.meta.get("opara_free"))
    return make_plan(graph.dag, policy, max_streams, order, fingerprint=graph.fingerprint, free_ops=free)


def graph_schedule(plan: Plan, graph: OpGraph) -> GraphSchedule:
    """Every fx node of `graph` in execution order with its lane, following `plan`."""
    nodes = list(graph.module.graph.nodes)
    stream: dict[str, int] = {}
    for node in nodes:  # graph order is topological, so inputs are resolved first
        if node.name in plan.stream:
            stream[node.name] = plan.stream[node.name]
        else:
            inputs = node.all_input_nodes
            stream[node.name] = stream[inputs[0].name] if inputs and node.op != "output" else 0
    pending = {node: len(node.all_input_nodes) for node in nodes}
    placed: list[str] = []
    kernels = plan.stream
    # Free nodes are placed as soon as their inputs are; the output node comes last.

    def place(node: Any) -> None:
        """Place `node`, then every free node that this makes ready (transitively)."""
        todo = deque([node])
        while todo:
            node = todo.popleft()
            placed.append(node.name)
            for user in node.users:
                pending[user] -= 1
                if not pending[user] and user.name not in kernels and user.op != "output":
                    todo.append(user)

    by_name = {node.name: node for node in nodes}
    for node in nodes:
        if not node.all_input_nodes and node.name not in kernels and node.op != "output":
            place(node)
    for name in plan.order:
        node = by_name[name]
        if pending[node]:
            raise ValueError(f"plan order runs {name!r} before one of its inputs")
        place(node)
    for node in nodes:
        if node.op == "output":
            place(node)
    if len(placed) != len(nodes):
        done = set(placed)
        missing = [node.name for node in nodes if node.name not in done]
        raise ValueError(f"plan does not cover the graph: {missing[:3]} never became ready")
    return GraphSchedule(stream=MappingProxyType(stream), order=tuple(placed))
