"""engine.heap: what a build keeps frozen against full collections, its garbage still collected."""

from __future__ import annotations

import gc
import weakref

from opara_core.engine import heap


class Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def test_objects_made_before_are_frozen_until_the_outermost_context_ends():
    assert gc.get_freeze_count() == 0
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


def test_freeze_more_freezes_only_inside_a_context():
    freeze_more_outside = gc.get_freeze_count()
    heap.freeze_more()
    assert gc.get_freeze_count() == freeze_more_outside == 0
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
        with heap.long_lived_frozen():
            [Node() for _ in range(50)]
            heap.freeze_more()
            assert gc.get_freeze_count() == own
        assert gc.get_freeze_count() == own, "its objects stay frozen"
    finally:
        gc.unfreeze()
