"""Cutting plans into segments (fused lanes): properties on random DAGs for every policy."""

from __future__ import annotations

import pytest
from engine_helpers import appendix_dag, dags
from hypothesis import given, settings
from hypothesis import strategies as st

from opara_core.planning import policies
from opara_core.planning.plan import make_plan, violations
from opara_core.planning.segments import segment_plan

SETTINGS = settings(max_examples=80, deadline=None)


@pytest.mark.parametrize("policy", policies.names())
@SETTINGS
@given(dag=dags(), budget=st.sampled_from([None, 1, 2, 3]))
def test_segments_partition_the_plan_and_keep_every_edge(policy, dag, budget):
    plan = make_plan(dag, policy, budget)
    cut = segment_plan(dag, plan)
    members = [name for segment in cut.plan.order for name in cut.members[segment]]
    assert sorted(members) == sorted(dag.names)  # every operator in exactly one segment
    assert violations(cut.dag, cut.plan) == []  # the segment plan is a valid schedule of the segment DAG
    position = {name: i for i, name in enumerate(plan.order)}
    for segment in cut.plan.order:
        names = cut.members[segment]
        assert {plan.stream[n] for n in names} == {cut.plan.stream[segment]}  # one lane
        assert [position[n] for n in names] == sorted(position[n] for n in names)  # the plan's launch order
    # running each segment whole, in segment order, runs every operator after its inputs
    ran = {name: i for i, name in enumerate(members)}
    for u, v in dag.edges:
        assert ran[u] < ran[v]
        if plan.stream[u] != plan.stream[v]:  # events only at segment ends, waits only at starts
            assert cut.members[cut.of[u]][-1] == u and cut.members[cut.of[v]][0] == v
            assert cut.of[u] != cut.of[v]


@SETTINGS
@given(dag=dags())
def test_a_one_lane_plan_is_one_segment(dag):
    cut = segment_plan(dag, make_plan(dag, "sequential"))
    assert len(cut.members) == 1 and cut.plan.waits == ()


def test_the_appendix_example_cuts_at_every_fork_and_join():
    dag = appendix_dag()
    plan = make_plan(dag, "opara")
    cut = segment_plan(dag, plan)
    # Alg. 1 puts the chains 1-2-5-8-9-11-13, 3-6, 4-7, 10, 12 on lanes; a fork or
    # join on another lane cuts the chain there.
    assert sum(cut.dag.costs) == sum(dag.costs)
    assert len(cut.plan.waits) == len(plan.waits)
    assert max(len(m) for m in cut.members.values()) < len(dag)
