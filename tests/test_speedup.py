"""Speedup math against brute force, edge cases and simulation through the real verifier."""

import itertools

import numpy as np
import pytest

from jspec.analysis.simulate import pair_with_overlap, simulate_chain
from jspec.analysis.speedup import (
    best_num_draft,
    estimate,
    expected_alpha,
    expected_tokens,
    expected_tokens_from_rates,
    linear_verify_cost,
    speedup,
)


def _brute_e(alpha, n):
    # Position k is emitted when the first k drafts were all accepted.
    return sum(alpha**k for k in range(n + 1))


@pytest.mark.parametrize(("alpha", "n"), list(itertools.product([0.0, 0.3, 0.6, 0.9, 0.999999, 1.0], [1, 2, 5, 64])))
def test_expected_tokens_matches_sum(alpha, n):
    assert expected_tokens(alpha, n) == pytest.approx(_brute_e(alpha, n), rel=1e-9)


def test_expected_tokens_is_continuous_at_one():
    assert expected_tokens(1 - 1e-12, 7) == pytest.approx(8.0, rel=1e-9)


def test_speedup_formula_and_verify_cost():
    e = _brute_e(0.8, 4)
    assert speedup(0.8, 4, 0.1) == pytest.approx(e / (1 + 0.4))
    assert speedup(0.8, 4, 0.1, verify_cost=2.5) == pytest.approx(e / (2.5 + 0.4))
    r = linear_verify_cost(1.0, 0.3)
    assert estimate(0.8, 5, 0.1, r).verify_cost == pytest.approx(2.5)


@pytest.mark.parametrize(
    ("alpha", "c", "slope"), list(itertools.product([0.6, 0.8, 0.95], [0.01, 0.05, 0.3], [0.0, 0.3]))
)
def test_best_n_is_the_argmax(alpha, c, slope):
    speeds = [_brute_e(alpha, n) / (1 + slope * n + n * c) for n in range(1, 65)]
    best = best_num_draft(alpha, c, linear_verify_cost(1.0, slope), max_draft=64)
    assert best.num_draft == int(np.argmax(speeds)) + 1
    assert best.speedup == pytest.approx(max(speeds))


def test_known_value():
    # alpha 0.8, c 0.05: E(8) = (1 - 0.8^9) / 0.2 = 4.3289, time 1.4 / E.
    best = best_num_draft(0.8, 0.05)
    assert best.num_draft == 8
    assert best.speedup == pytest.approx(4.32891136 / 1.4, rel=1e-6)


def test_speculation_not_worthwhile_is_reported():
    est = best_num_draft(0.2, 0.9, verify_cost=2.0)
    assert not est.worthwhile and est.speedup < 1


def test_per_position_rates():
    assert expected_tokens_from_rates([0.7] * 5) == pytest.approx(expected_tokens(0.7, 5))
    assert expected_tokens_from_rates([1.0, 0.0, 1.0]) == pytest.approx(2.0)


def test_expected_alpha():
    p = np.array([[0.5, 0.5, 0.0]])
    assert expected_alpha(p, p) == pytest.approx(1.0)
    assert expected_alpha(p, np.array([[0.0, 0.0, 1.0]])) == 0.0
    assert expected_alpha(p, np.array([[0.2, 0.2, 0.6]])) == pytest.approx(0.4)


def test_pair_with_overlap_has_that_overlap():
    import jax

    for alpha in (0.0, 0.35, 0.9, 1.0):
        p, q = pair_with_overlap(jax.random.PRNGKey(1), alpha, 20)
        assert expected_alpha(p, q) == pytest.approx(alpha, abs=1e-6)


@pytest.mark.parametrize(("alpha", "n"), [(0.6, 3), (0.9, 6)])
def test_simulated_tokens_per_verify_match_e(alpha, n):
    run = simulate_chain(alpha, n, steps=20_000, seed=n)
    assert abs(run.measured_tokens - run.expected_tokens) < 4 * run.measured_tokens_stderr
    assert abs(run.measured_alpha - alpha) < 0.01
    # Negative control: the same data rejects a formula off by 0.05 in alpha.
    assert abs(run.measured_tokens - expected_tokens(alpha - 0.05, n)) > 4 * run.measured_tokens_stderr


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: expected_tokens(1.2, 3), "alpha"),
        (lambda: expected_tokens(0.5, 0), "N must be"),
        (lambda: speedup(0.5, 2, -0.1), "cost ratio"),
        (lambda: speedup(0.5, 2, 0.1, verify_cost=0.0), "verify cost"),
        (lambda: linear_verify_cost(1.0, -1.0), "slope"),
        (lambda: expected_tokens_from_rates([]), "alphas"),
        (lambda: expected_alpha(np.ones((2, 3)) / 3, np.ones((2, 4)) / 4), "same shape"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
