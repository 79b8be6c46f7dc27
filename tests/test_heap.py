"""engine.heap: what a build keeps frozen against full collections, its garbage still collected."""

from __future__ import annotations

import gc
import importlib
import weakref

from opara_core.engine import heap


class Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def test_objects_made_before_are_frozen_until_the_outermost_context_ends():
    kept = [Node() for _ in range(100)]
    with heap.long_lived_frozen():
        assert gc.get_freeze_count() >= len(kept)
        with heap.long_lived_frozen():
            pass
        assert gc.get_freeze_count() >= len(kept), "an inner context must not unfreeze"
    assert gc.get_freeze_count() == 0


def test_garbage_made_inside_is_collected_and_garbage_frozen_is_collected_after():
    before = Node()
    early = weakref.ref(before)
    with heap.long_lived_frozen():
        made = Node()
        inside = weakref.ref(made)
        del before, made
        gc.collect()
        assert inside() is None, "a cycle the build made and dropped must be collected during the build"
        assert early() is not None, "frozen: a collection during the build skips it"
    gc.collect()
    assert early() is None, "after the build the collector frees it again"


class Generations:
    """gc.callbacks: the generation of every collection that started."""

    def __init__(self):
        self.seen = []

    def __call__(self, phase, info):
        if phase == "start":
            self.seen.append(info["generation"])


def _churn(survivors):
    """Cycles that live long enough to be promoted, as a build's loads make them."""
    for _ in range(200):
        survivors.extend(Node() for _ in range(1000))
        del survivors[: len(survivors) // 2]


def test_no_full_collection_runs_inside_the_context_and_the_policy_comes_back_after():
    before = gc.get_threshold()
    generations = Generations()
    gc.callbacks.append(generations)
    try:
        with heap.long_lived_frozen():
            gc.collect()  # as a build's first full one: CPython then sizes the next by what is left unfrozen
            start = len(generations.seen)
            _churn([])
            inside = generations.seen[start:]
        assert 1 in inside, "the churn promotes objects: generation 1 still collects"
        assert 2 not in inside
        assert gc.get_threshold() == before
        _churn([])
        assert 2 in generations.seen[start + len(inside) :], "outside, the same churn brings full collections again"
    finally:
        gc.callbacks.remove(generations)


def test_a_cycle_promoted_and_dropped_inside_is_freed_when_the_context_ends():
    with heap.long_lived_frozen():
        promoted = Node()
        dropped = weakref.ref(promoted)
        gc.collect(1)
        gc.collect(1)  # now in the oldest generation, where only a full collection looks
        del promoted
        gc.collect(1)
        assert dropped() is not None, "full collections are off inside"
    assert dropped() is None, "the build's garbage must not outlive it (GPU memory a dropped graph holds)"


def test_freeze_more_freezes_only_inside_a_context():
    freeze_more_outside = gc.get_freeze_count()
    heap.freeze_more()
    assert gc.get_freeze_count() == freeze_more_outside
    with heap.long_lived_frozen():
        frozen = gc.get_freeze_count()
        graph = [Node() for _ in range(50)]
        heap.freeze_more()
        assert gc.get_freeze_count() >= frozen + len(graph)
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_keeps_them_frozen_and_nothing_more():
    gc.freeze()
    try:
        own = gc.get_freeze_count()
        thresholds = gc.get_threshold()
        # frozen objects that die leave the count (another thread of the test process may free
        # some meanwhile: CI saw it fall by 2), so "nothing more" is at most, "stay" nearly all
        with heap.long_lived_frozen():
            [Node() for _ in range(50)]
            heap.freeze_more()
            assert gc.get_freeze_count() <= own, "nothing more frozen"
            assert gc.get_threshold() == thresholds, "nor its collection policy changed"
        assert gc.get_freeze_count() >= 0.99 * own, "its objects stay frozen"
    finally:
        gc.unfreeze()


def test_objects_frozen_before_the_module_was_imported_leave_the_policy_on():
    """CPython 3.12 starts with objects of its own frozen; its builds must still freeze theirs."""
    gc.freeze()  # as the interpreter's own, there before the engine is imported
    importlib.reload(heap)
    generations = Generations()
    gc.callbacks.append(generations)
    try:
        with heap.long_lived_frozen():
            frozen = gc.get_freeze_count()
            graph = [Node() for _ in range(50)]
            heap.freeze_more()
            assert gc.get_freeze_count() >= frozen + len(graph)
            gc.collect()
            start = len(generations.seen)
            _churn([])
            assert 2 not in generations.seen[start:]
    finally:
        gc.callbacks.remove(generations)
        gc.unfreeze()
        importlib.reload(heap)
