"""scripts/varlen_memory.py: the orders in which first uses build shapes (the
measurement itself needs a GPU)."""

import pytest

from conftest import load_script
from opara_core.planning import batching

varlen_memory = load_script("varlen_memory")


def test_first_use_orders_build_every_shape_but_the_smallest_once():
    grid = batching.grid(((16, 32, 64, 512), (16, 128)))
    for order in varlen_memory.ORDERS:
        shapes = varlen_memory.build_order(grid, order)
        assert sorted(shapes) == sorted(grid[1:])
    ascending = varlen_memory.build_order(grid, "ascending")
    assert [a * b for a, b in ascending] == sorted(a * b for a, b in grid[1:])
    assert varlen_memory.build_order(grid, "random") == varlen_memory.build_order(grid, "random")  # seeded
    assert varlen_memory.build_order(grid, "random") != grid[1:]
    with pytest.raises(ValueError, match="unknown order 'load'"):
        varlen_memory.build_order(grid, "load")  # load is no first-use order: measure() builds it at once
