"""Run a plan on the CPU: every node of the traced graph in the plan's order.

The oracle for plans without a GPU: if a plan's order ever ran an operator before
its inputs (or dropped one), the outputs would differ from eager or the run would
fail. Streams do not exist on the CPU; the lane of each node is recorded with it.
"""

from __future__ import annotations

from typing import Any

import torch

from opara_core.graph import OpGraph
from opara_core.plan import GraphSchedule, Plan, graph_schedule


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
