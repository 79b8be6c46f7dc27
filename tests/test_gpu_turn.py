"""engine.gpu_turn: model builds of several processes take turns on a GPU,
and a build that only compiles leaves the GPU to the others meanwhile."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from conftest import turn_is_free
from opara_core.engine import gpu_turn

CONTEXT = multiprocessing.get_context("spawn")


def _hold(path, seconds, ready):
    with gpu_turn.held(path):
        ready.set()
        time.sleep(seconds)


def _probe(path, answer):
    answer.put(turn_is_free(path))


def _free_in_another_process(path) -> bool:
    answer = CONTEXT.Queue()
    probe = CONTEXT.Process(target=_probe, args=(path, answer))
    probe.start()
    found = answer.get(timeout=60)
    probe.join(30)
    return found


def test_builds_take_turns_on_a_gpu_across_processes(tmp_path):
    path = tmp_path / "gpu.lock"
    ready = CONTEXT.Event()
    holder = CONTEXT.Process(target=_hold, args=(path, 1.5, ready))
    holder.start()
    assert ready.wait(60)
    start = time.perf_counter()
    with gpu_turn.held(path):
        waited = time.perf_counter() - start
    holder.join(30)
    assert holder.exitcode == 0
    assert waited >= 1.0, waited


def test_a_build_that_compiles_leaves_the_gpu_to_others_and_takes_its_turn_back(tmp_path):
    path = tmp_path / "gpu.lock"
    with gpu_turn.held(path):
        assert gpu_turn.holding()
        assert not _free_in_another_process(path)
        with gpu_turn.aside("compiling"):
            assert not gpu_turn.holding()
            assert _free_in_another_process(path)
            with gpu_turn.aside("compiling inside"):  # nested: nothing more to give, and no deadlock
                assert not gpu_turn.holding()
        assert gpu_turn.holding()
        assert not _free_in_another_process(path)
    assert _free_in_another_process(path)


def test_the_turn_comes_back_only_after_the_other_build_is_done_with_the_gpu(tmp_path):
    path = tmp_path / "gpu.lock"
    ready = CONTEXT.Event()
    with gpu_turn.held(path):
        with gpu_turn.aside("compiling"):
            other = CONTEXT.Process(target=_hold, args=(path, 1.5, ready))
            other.start()
            assert ready.wait(60)
            start = time.perf_counter()
        waited = time.perf_counter() - start
        other.join(30)
    assert waited >= 1.0, waited


def test_outside_a_turn_stepping_aside_does_nothing_and_a_second_turn_is_refused(tmp_path):
    path = tmp_path / "gpu.lock"
    with gpu_turn.aside("compiling"):
        assert turn_is_free(path)
    with gpu_turn.held(path):
        with pytest.raises(RuntimeError, match="already holds"):
            with gpu_turn.held(path):
                pass
    assert not gpu_turn.holding()


def test_a_turn_held_lazily_is_taken_when_the_build_asks_and_then_works_as_any(tmp_path):
    path = tmp_path / "gpu.lock"
    with gpu_turn.held(path, lazily=True):
        assert not gpu_turn.holding() and _free_in_another_process(path)
        with gpu_turn.aside("tracing"):  # before the turn is taken: nothing to give, nothing taken after
            assert _free_in_another_process(path)
        assert not gpu_turn.holding() and _free_in_another_process(path)
        gpu_turn.take()
        assert gpu_turn.holding() and not _free_in_another_process(path)
        gpu_turn.take()  # taken already: nothing more
        with gpu_turn.aside("compiling"):
            assert _free_in_another_process(path)
        assert gpu_turn.holding() and not _free_in_another_process(path)
        with pytest.raises(RuntimeError, match="already holds"):
            with gpu_turn.held(path):
                pass
    assert not gpu_turn.holding() and _free_in_another_process(path)
    gpu_turn.take()  # outside a turn: nothing
    assert not gpu_turn.holding() and turn_is_free(path)


def test_taking_a_lazily_held_turn_waits_for_the_build_that_has_it(tmp_path):
    path = tmp_path / "gpu.lock"
    ready = CONTEXT.Event()
    with gpu_turn.held(path, lazily=True):
        other = CONTEXT.Process(target=_hold, args=(path, 1.5, ready))
        other.start()  # takes the turn while this build has not yet asked for it
        assert ready.wait(60)
        start = time.perf_counter()
        gpu_turn.take()
        waited = time.perf_counter() - start
        other.join(30)
    assert other.exitcode == 0
    assert waited >= 1.0, waited
