"""Self-checks of the independent references against known values and brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tests.reference import gini_pairwise, gini_sorted_rank
from tests.training_reference import (
    brute_best_at_k,
    brute_min_max_partition,
    ref_best_at_k,
    ref_karmarkar_karp_sums,
    ref_pass_at_k,
)


@pytest.mark.parametrize(
    "values,expected",
    [([1, 1, 1], 0.0), ([0, 0, 0, 1], 0.75), ([1, 2, 3, 4], 0.25), ([5], 0.0), ([0, 0], 0.0), ([-1, 1], 0.0),
     ([1, 3], 0.25)],
)
def test_reference_gini_known_values(values, expected):
    assert gini_pairwise(values) == pytest.approx(expected, abs=1e-15)
    assert gini_sorted_rank(values) == pytest.approx(expected, abs=1e-15)


def test_reference_gini_forms_agree():
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.exponential(size=rng.integers(1, 12)) * rng.integers(0, 2, 1)
        assert math.isclose(gini_pairwise(x), gini_sorted_rank(x), rel_tol=1e-12, abs_tol=1e-14)


def test_pass_at_k_reference_matches_enumeration():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                outcomes = [1] * c + [0] * (n - c)
                subsets = list(itertools.combinations(outcomes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert math.isclose(ref_pass_at_k(n, c, k), brute, rel_tol=1e-12), (n, c, k)


def test_best_at_k_reference_matches_enumeration():
    rng = np.random.default_rng(0)
    for n in range(1, 7):
        vals = [float(v) for v in rng.normal(size=n).round(3)]
        vals[0] = vals[-1]  # a tie
        for k in range(1, n + 1):
            assert math.isclose(ref_best_at_k(vals, k), brute_best_at_k(vals, k), rel_tol=1e-12, abs_tol=1e-12)


def test_karmarkar_karp_reference_is_sane():
    rng = np.random.default_rng(1)
    for _ in range(20):
        k = int(rng.integers(2, 4))
        lengths = [int(x) for x in rng.integers(1, 50, size=int(rng.integers(k, 8)))]
        sums = ref_karmarkar_karp_sums(lengths, k)
        assert math.isclose(sum(sums), sum(lengths))
        assert max(sums) >= brute_min_max_partition(lengths, k) - 1e-9
    # worked by hand: largest differencing 8-7, 6-5, 4-1, 3-1 leaves 2 (sums 14, 16); equal sizes, k = 3: the
    # triples (5, 4, 3) and (8, 7, 6) merged largest with smallest
    assert ref_karmarkar_karp_sums([8, 7, 6, 5, 4], 2, equal_size=False) == [14.0, 16.0]
    assert ref_karmarkar_karp_sums([8, 7, 6, 5, 4, 3], 3) == [11.0, 11.0, 11.0]
