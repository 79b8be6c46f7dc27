"""The iteration-level scheduler's bookkeeping, driven by a fake decoding step
(no torch, no server): hypothesis draws arrivals, lengths, stop ids and
cancellations, and every run must keep the limits and serve every request."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opara_core.planning.iteration import ITERATION, REQUEST, Limits, Rejected, Scheduler, Sequence


def fake_token(sequence: Sequence) -> int:
    """A deterministic 'model': the next token depends on the request and its position."""
    return (sequence.key * 7 + len(sequence.generated) * 3) % 11


request_strategy = st.tuples(
    st.integers(0, 6),  # arrival iteration
    st.integers(1, 12),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.one_of(st.none(), st.integers(0, 10)),  # end id
    st.one_of(st.none(), st.integers(0, 20)),  # cancelled at this iteration
)


def run(mode: str, limits: Limits, requests: list[tuple], admit_every: int = 1) -> dict:
    """Drive a scheduler to the end; check the invariants at every iteration."""
    scheduler = Scheduler(limits, mode, admit_every)
    rejected, finished, joined_running, held = set(), {}, False, 0
    for iteration in range(500):
        for key, (arrival, prompt, max_tokens, end_id, _) in enumerate(requests):
            if arrival == iteration:
                try:
                    scheduler.submit(Sequence(key, prompt, max_tokens, end_id))
                except Rejected:
                    rejected.add(key)
        for key, (*_, cancel_at) in enumerate(requests):
            if cancel_at == iteration:
                scheduler.cancel(key)
        for sequence in scheduler.retire():
            finished[sequence.key] = sequence
        running_before = bool(scheduler.active)
        head = scheduler.waiting[0] if scheduler.waiting else None
        could_join = head is not None and bool(scheduler.free_slots) and scheduler.reserved + head.reservation <= limits.kv_tokens
        admitted = scheduler.admit()
        held = held + 1 if running_before and could_join and not admitted else 0
        assert mode == REQUEST or held < admit_every  # a waiter with a free slot is held at most admit_every - 1 iterations
        joined_running |= bool(admitted) and running_before
        for sequence in admitted:  # prefill gives the first token
            scheduler.record(sequence.key, fake_token(sequence))
        for sequence in scheduler.step_batch():
            scheduler.record(sequence.key, fake_token(sequence))
        # invariants
        slots = [s.slot for s in scheduler.active.values()]
        assert len(slots) == len(set(slots)) <= limits.max_active
        assert all(0 <= slot < limits.max_active for slot in slots)
        assert scheduler.reserved == sum(s.reservation for s in scheduler.active.values()) <= limits.kv_tokens
        assert all(s.length <= s.prompt_len + s.max_tokens for s in scheduler.active.values())
        for sequence in scheduler.retire():
            finished[sequence.key] = sequence
        if iteration > max(r[0] for r in requests) and scheduler.idle:
            break
    assert scheduler.idle and scheduler.reserved == 0 and sorted(scheduler.free_slots) == list(range(limits.max_active))
    return {"rejected": rejected, "finished": finished, "joined_running": joined_running}


@settings(max_examples=150, deadline=None)
@given(
    mode=st.sampled_from([ITERATION, REQUEST]),
    max_active=st.integers(1, 4),
    kv_tokens=st.integers(23, 60),
    max_queue=st.integers(0, 5),
    requests=st.lists(request_strategy, min_size=1, max_size=12),
    admit_every=st.integers(1, 4),
)
def test_every_request_is_served_or_refused_and_the_limits_hold(mode, max_active, kv_tokens, max_queue, requests, admit_every):
    limits = Limits(max_active=max_active, kv_tokens=kv_tokens, max_context=23, max_queue=max_queue)
    outcome = run(mode, limits, requests, admit_every)
    finished, rejected = outcome["finished"], outcome["rejected"]
    for key, (_, prompt, max_tokens, end_id, _) in enumerate(requests):
        if key in rejected:
            continue
        if key not in finished:  # a waiting request that was cancelled is dropped without a step
            assert requests[key][4] is not None
            continue
        sequence = finished[key]
        if sequence.cancelled:
            assert requests[key][4] is not None
            continue
        tokens = sequence.generated
        # stopped exactly at max_tokens or at the first end id
        expected_len = max_tokens
        if end_id is not None and end_id in tokens:
            expected_len = tokens.index(end_id) + 1
        assert len(tokens) == expected_len, (key, tokens, max_tokens, end_id)
    if mode == REQUEST:
        assert not outcome["joined_running"]


def test_iteration_level_lets_a_short_request_join_and_leave_early():
    """One slot free beside a long request: the short one arriving later joins
    at the next iteration and finishes long before the long one."""
    limits = Limits(max_active=2, kv_tokens=100, max_context=50, max_queue=4)
    scheduler = Scheduler(limits, ITERATION)
    scheduler.submit(Sequence(0, prompt_len=3, max_tokens=30))
    log = []
    for iteration in range(40):
        if iteration == 2:
            scheduler.submit(Sequence(1, prompt_len=2, max_tokens=3))
        for sequence in scheduler.admit():
            scheduler.record(sequence.key, 1)
        for sequence in scheduler.step_batch():
            scheduler.record(sequence.key, 1)
        log += [(iteration, s.key) for s in scheduler.retire()]
    assert log == [(3, 1), (28, 0)]  # prefill and a step in the iteration that admits


def test_request_level_makes_a_late_request_wait_for_the_whole_batch():
    limits = Limits(max_active=2, kv_tokens=100, max_context=50, max_queue=4)
    scheduler = Scheduler(limits, REQUEST)
    scheduler.submit(Sequence(0, prompt_len=3, max_tokens=30))
    admitted_at = {}
    for iteration in range(40):
        if iteration == 2:
            scheduler.submit(Sequence(1, prompt_len=2, max_tokens=3))
        for sequence in scheduler.admit():
            admitted_at[sequence.key] = iteration
            scheduler.record(sequence.key, 1)
        for sequence in scheduler.step_batch():
            scheduler.record(sequence.key, 1)
        scheduler.retire()
    assert admitted_at == {0: 0, 1: 29}  # the iteration after the long one retired


def test_the_kv_budget_holds_back_a_request_that_does_not_fit_yet():
    limits = Limits(max_active=4, kv_tokens=20, max_context=20, max_queue=4)
    scheduler = Scheduler(limits, ITERATION)
    scheduler.submit(Sequence(0, prompt_len=5, max_tokens=10))  # reserves 14
    scheduler.submit(Sequence(1, prompt_len=5, max_tokens=3))  # 7: 21 > 20 waits
    assert [s.key for s in scheduler.admit()] == [0]
    assert [s.key for s in scheduler.waiting] == [1]


@pytest.mark.parametrize(
    ("sequence", "problem"),
    [
        (Sequence(0, prompt_len=0, max_tokens=3), "empty"),
        (Sequence(0, prompt_len=3, max_tokens=0), "max_tokens"),
        (Sequence(0, prompt_len=15, max_tokens=10), "allows 20"),
    ],
)
def test_impossible_requests_are_refused_with_the_reason(sequence, problem):
    scheduler = Scheduler(Limits(max_active=2, kv_tokens=40, max_context=20, max_queue=4))
    with pytest.raises(Rejected, match=problem):
        scheduler.submit(sequence)


def test_the_queue_limit_counts_only_requests_that_find_no_free_slot():
    scheduler = Scheduler(Limits(max_active=2, kv_tokens=100, max_context=20, max_queue=1))
    for key in range(3):  # two fill the free slots, one waits
        scheduler.submit(Sequence(key, 2, 2))
    with pytest.raises(Rejected, match=r"overloaded: 0 requests generating and 1 waiting \(queue limit 1\)"):
        scheduler.submit(Sequence(3, 2, 2))


def test_admit_every_lets_arrivals_wait_to_join_one_prefill_together():
    """admit_every=3 beside a running request: two requests arriving one
    iteration apart join together at the third iteration of the first's wait;
    with nothing running, a request joins at once."""
    scheduler = Scheduler(Limits(max_active=4, kv_tokens=200, max_context=50, max_queue=4), ITERATION, admit_every=3)
    scheduler.submit(Sequence(0, 2, 30))
    assert [s.key for s in scheduler.admit()] == [0]  # nothing was running
    scheduler.submit(Sequence(1, 2, 5))
    assert scheduler.admit() == []  # held 1
    scheduler.submit(Sequence(2, 2, 5))
    assert scheduler.admit() == []  # held 2
    assert [s.key for s in scheduler.admit()] == [1, 2]
    assert scheduler.admit() == []  # nobody waiting


def test_bad_limits_and_modes_are_refused():
    with pytest.raises(ValueError, match="max_active"):
        Limits(max_active=0, kv_tokens=1, max_context=1, max_queue=0)
    with pytest.raises(ValueError, match="scheduling"):
        Scheduler(Limits(1, 1, 1, 0), "orca")
    with pytest.raises(ValueError, match="admit_every must be >= 1"):
        Scheduler(Limits(1, 1, 1, 0), ITERATION, admit_every=0)
