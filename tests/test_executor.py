"""The CPU executor runs a plan's order and matches eager PyTorch on every zoo model."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import traced
from torch.utils._pytree import tree_leaves

from opara_core import policies, zoo
from opara_core.executor import PlanInterpreter, run_plan
from opara_core.plan import graph_schedule, plan_graph


def _assert_same(actual, expected):
    actual, expected = tree_leaves(actual), tree_leaves(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("name", zoo.names())
def test_plan_execution_equals_eager(name):
    """Opara's plan (Alg. 2 order, most streams) against the eager module, batch 1."""
    graph = traced(name)
    model = zoo.get(name)
    inputs = model.example_inputs(1, seed=1)
    with torch.no_grad():
        expected = model.build()(*inputs)
    _assert_same(run_plan(graph, plan_graph(graph, "opara"), *inputs), expected)


@pytest.mark.parametrize("policy", policies.names())
def test_every_policy_and_budget_runs_correctly(policy):
    graph = traced("deepfm")  # small and wide: many lanes, many orders differ
    model = zoo.get("deepfm")
    inputs = model.example_inputs(3, seed=2)  # another batch size than traced
    with torch.no_grad():
        expected = model.build()(*inputs)
    for budget in (None, 2):
        _assert_same(run_plan(graph, plan_graph(graph, policy, budget), *inputs), expected)


def test_nodes_run_in_the_plans_order_on_their_lanes():
    graph = traced("deepfm")
    plan = plan_graph(graph, "opara", order="critical_path")
    interpreter = PlanInterpreter(graph, plan)
    with torch.no_grad():
        interpreter.run(*zoo.get("deepfm").example_inputs(1))
    schedule = graph_schedule(plan, graph)
    assert [name for name, _ in interpreter.executed] == list(schedule.order)
    assert [name for name, _ in interpreter.executed if name in plan.stream] == list(plan.order)
    assert all(lane == schedule.stream[name] for name, lane in interpreter.executed)
