"""The engine's one comparison: max relative error over nested outputs."""

from __future__ import annotations

import math

import pytest
import torch

from opara_core.engine.compare import max_relative_error


def test_relative_to_the_largest_expected_magnitude():
    want = torch.tensor([10.0, -20.0, 1.0])
    assert max_relative_error(want + torch.tensor([0.0, 0.0, 0.2]), want) == pytest.approx(0.01)


def test_worst_over_nested_outputs_and_exact_integers():
    want = (torch.ones(3), [torch.arange(4), torch.full((2,), 4.0)])
    got = (torch.ones(3), [torch.arange(4), torch.tensor([4.0, 4.4])])
    assert max_relative_error(got, want) == pytest.approx(0.1)
    assert max_relative_error((torch.ones(3), [torch.arange(4) + 1, want[1][1]]), want) == math.inf


def test_equal_infinities_are_right_and_any_other_is_wrong():
    want = torch.tensor([-math.inf, 2.0, math.inf])  # masked attention scores overflow to -inf
    assert max_relative_error(want.clone(), want) == 0.0
    assert max_relative_error(torch.tensor([-math.inf, 2.1, math.inf]), want) == pytest.approx(0.05)
    assert max_relative_error(torch.tensor([math.inf, 2.0, math.inf]), want) == math.inf
    assert max_relative_error(torch.tensor([-3.0e38, 2.0, math.inf]), want) == math.inf


def test_nan_is_never_within_a_tolerance():
    want = torch.tensor([1.0, math.nan])
    assert not max_relative_error(want.clone(), want) <= 1.0
    assert not max_relative_error(torch.tensor([1.0, math.nan]), torch.ones(2)) <= 1.0


def test_mismatched_structure_is_refused():
    with pytest.raises(ValueError, match="outputs instead of"):
        max_relative_error([torch.ones(2)], [torch.ones(2), torch.ones(2)])
    with pytest.raises(ValueError, match="shape"):
        max_relative_error(torch.ones(2), torch.ones(3))
