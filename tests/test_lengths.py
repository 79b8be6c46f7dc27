"""Seeded request-length distributions for `--lengths` (client.lengths)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client import lengths
from client.inputs import InputError


def test_lognormal_is_seeded_capped_and_near_its_mean():
    spec = lengths.parse("lognormal:mean=50,cap=512,seed=1")
    drawn = spec.lengths(20000)
    np.testing.assert_array_equal(drawn, lengths.parse("lognormal:mean=50,cap=512,seed=1").lengths(20000))
    assert not np.array_equal(drawn, lengths.parse("lognormal:mean=50,cap=512,seed=2").lengths(20000))
    assert drawn.min() >= 1 and drawn.max() == 512, "a tail reaching the cap"
    assert 45 < drawn.mean() < 55 and np.median(drawn) < drawn.mean(), "short text with a long tail"


@settings(max_examples=50, deadline=None)
@given(mean=st.floats(1, 1000), cap=st.integers(1, 2048), sigma=st.floats(0.05, 3), n=st.integers(1, 300))
def test_lognormal_lengths_stay_in_one_to_cap(mean, cap, sigma, n):
    drawn = lengths.parse(f"lognormal:mean={mean},cap={cap},seed=3,sigma={sigma}").lengths(n)
    assert drawn.shape == (n,) and drawn.min() >= 1 and drawn.max() <= cap


def test_a_file_of_lengths_is_cycled(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("3, 17\n40\n")
    assert lengths.parse(f"file:{path}").lengths(5).tolist() == [3, 17, 40, 3, 17]
    assert lengths.parse("fixed:9").lengths(2).tolist() == [9, 9]


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("normal:mean=3", "use lognormal"),
        ("lognormal:mean=50", "give lognormal:mean=M,cap=C"),
        ("lognormal:mean=50,cap=512,skew=1", "give lognormal"),
        ("lognormal:mean=x,cap=512", "must be numbers"),
        ("lognormal:mean=0.5,cap=512", "mean must be >= 1"),
        ("lognormal:mean=50,cap=0", "cap: 0 is below 1"),
        ("fixed:-2", "below 1"),
        ("file:/nonexistent/lengths", "cannot read"),
    ],
)
def test_a_bad_spec_names_the_problem(spec, problem):
    with pytest.raises(InputError, match=problem):
        lengths.parse(spec)
