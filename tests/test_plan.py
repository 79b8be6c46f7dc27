"""Plans as data: JSON round-trip, summary, waits and validation."""

from __future__ import annotations

import json

import pytest
from engine_helpers import appendix_dag

from opara_core.planning import policies
from opara_core.planning.dag import Dag, OpNode
from opara_core.planning.plan import (
    CONTRACT_KEYS,
    Plan,
    compute_waits,
    estimate_makespan,
    make_plan,
    violations,
)


@pytest.mark.parametrize("policy", policies.names())
def test_json_round_trip(policy):
    plan = make_plan(appendix_dag(), policy, max_streams=2)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    assert again.to_json() == plan.to_json()
    assert list(plan.to_json())[: len(CONTRACT_KEYS)] == list(CONTRACT_KEYS)


def test_contract_json_has_exactly_the_contract_keys_and_reads_back():
    plan = make_plan(appendix_dag(), "opara")
    contract = plan.contract_json()
    assert tuple(contract) == CONTRACT_KEYS
    back = Plan.from_json(contract)
    assert back.stream == plan.stream and back.order == plan.order and back.waits == plan.waits
    assert back.priorities == (0,) * plan.num_streams


def test_from_json_names_a_missing_key():
    with pytest.raises(ValueError, match="'waits'"):
        Plan.from_json({"policy": "x", "num_streams": 1, "stream": {}, "order": []})


def test_plan_is_frozen():
    plan = make_plan(appendix_dag(), "opara")
    with pytest.raises(AttributeError):
        plan.policy = "other"
    with pytest.raises(TypeError):
        plan.stream["1"] = 3


def test_summary_names_ops_streams_waits_and_critical_path():
    plan = make_plan(appendix_dag(), "opara", fingerprint="sha256:abc", free_ops=4)
    text = plan.summary()
    assert "13 kernels, 4 free" in text
    assert "streams         5" in text
    assert "waits           8" in text
    assert "critical path   7.0 us" in text
    assert "sha256:abc" in text


def test_waits_skip_what_an_earlier_wait_already_covers():
    # a (lane 0) -> b (lane 1) -> c (lane 2), and a -> c: c waiting on b covers a.
    dag = Dag(tuple(OpNode(n) for n in "abc"), (("a", "b"), ("b", "c"), ("a", "c")))
    assert compute_waits(dag, (0, 1, 2), (0, 1, 2)) == [(0, 1), (1, 2)]
    # Same lane needs nothing.
    assert compute_waits(dag, (0, 0, 0), (0, 1, 2)) == []


def test_waits_take_the_latest_producer_first():
    # d needs a and c, both on lane 0; waiting on c (launched later) covers a.
    dag = Dag(tuple(OpNode(n) for n in "abcd"), (("a", "b"), ("b", "c"), ("a", "d"), ("c", "d")))
    assert compute_waits(dag, (0, 0, 0, 1), (0, 1, 2, 3)) == [(2, 3)]


def test_violations_catch_every_kind_of_mistake():
    dag = Dag(tuple(OpNode(n) for n in "ab"), (("a", "b"),))
    good = Plan("x", 2, {"a": 0, "b": 1}, ("a", "b"), (("a", "b"),))
    assert violations(dag, good) == []
    assert "edge 'a' -> 'b' is not enforced" in violations(dag, Plan("x", 2, {"a": 0, "b": 1}, ("a", "b"), ()))
    assert any("before its input" in p for p in violations(dag, Plan("x", 1, {"a": 0, "b": 0}, ("b", "a"), ())))
    assert any("to itself" in p for p in violations(dag, Plan("x", 1, {"a": 0, "b": 0}, ("a", "b"), (("a", "b"),))))
    assert any("not 0..1" in p for p in violations(dag, Plan("x", 2, {"a": 0, "b": 2}, ("a", "b"), (("a", "b"),))))
    with pytest.raises(ValueError, match="invalid plan: edge 'a' -> 'b' is not enforced"):
        Plan("x", 2, {"a": 0, "b": 1}, ("a", "b"), ()).check(dag)


def test_estimated_time_is_the_sum_on_one_lane_and_the_critical_path_on_many():
    dag = appendix_dag()
    assert make_plan(dag, "sequential").estimated_us == 13
    assert make_plan(dag, "nimble").estimated_us == dag.critical_path_us == 7
    assert estimate_makespan(dag, (0,) * 13, range(13)) == 13


def test_a_launch_order_can_be_chosen_and_keeps_the_lanes():
    dag = appendix_dag()
    own = make_plan(dag, "opara")
    topo = make_plan(dag, "opara", order="topological")
    assert own.launch_order == "opara" and topo.launch_order == "topological"
    assert topo.order == dag.names and topo.stream == own.stream
    assert violations(dag, topo) == []


def test_budget_below_one_is_rejected():
    with pytest.raises(ValueError, match="max_streams"):
        make_plan(appendix_dag(), "opara", max_streams=0)
