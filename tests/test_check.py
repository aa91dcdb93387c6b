"""The Leviathan check passes on the real verifier and fails on a broken one."""

import numpy as np
import pytest

from jspec.analysis.check import CheckConfig, run_check, two_sample_chi2, verify_chain_without_residual


def test_check_passes_with_the_real_verifier():
    result = run_check(CheckConfig(steps=20_000, num_draft=4, vocab=16, seed=1))
    assert result.passed, result
    assert result.dof > 20
    assert len(result.per_position) == 5 and all(row["emitted"] > 0 for row in result.per_position)
    assert result.acceptance_rate == pytest.approx(result.expected_acceptance_rate, abs=0.01)
    assert result.tokens_per_step == pytest.approx(result.expected_tokens_per_step, rel=0.02)


def test_check_fails_with_the_residual_skipped():
    result = run_check(CheckConfig(steps=20_000, seed=1), verifier=verify_chain_without_residual)
    assert not result.passed
    assert result.chi2 > 3 * result.critical


def test_distance_zero_accepts_every_draft():
    result = run_check(CheckConfig(steps=5_000, num_draft=3, distance=0.0))
    assert result.acceptance_rate == 1.0 and result.tokens_per_step == 4.0
    assert result.passed


def test_two_sample_chi2():
    assert two_sample_chi2(np.array([50, 30, 20]), np.array([50, 30, 20])) == (0.0, 2)
    chi2, dof = two_sample_chi2(np.array([90, 10, 0]), np.array([10, 90, 0]))
    assert dof == 1 and chi2 > 100


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(steps=10), "steps"),
        (dict(num_draft=0), "num_draft"),
        (dict(vocab=1), "vocab"),
        (dict(distance=1.5), "distance"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckConfig(**kwargs)
