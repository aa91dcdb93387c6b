"""Logits to distributions: temperature, top-k, top-p, greedy, and their validation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jspec import SamplingParams, check_distribution, probs_from_logits, sample

# A few vocabulary sizes only: every new shape costs a compilation.
logit_rows = hnp.arrays(np.float32, st.sampled_from([2, 7, 40]), elements=st.floats(-8, 8, width=32))


def _reference(logits, temperature, top_k, top_p):
    """Plain numpy: temperature, then top-k, then top-p (the smallest set reaching top_p)."""
    x = np.asarray(logits, np.float64)
    if temperature == 0:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1.0
        return out
    x = x / temperature
    if top_k:
        kth = np.sort(x)[::-1][min(top_k, x.size) - 1]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-x, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(x.size, bool)
    keep[order[before < top_p]] = True
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


# Jitted: the knobs are arrays, so each vocabulary size compiles once (eagerly, every example
# dispatched the threshold searches op by op: 40 s for this test).
_probs_jit = jax.jit(probs_from_logits)


@given(
    logit_rows,
    st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    st.integers(0, 50),
    st.sampled_from([1.0, 0.95, 0.5, 0.1]),
)
def test_matches_numpy_reference(logits, temperature, top_k, top_p):
    # Distinct logits keep the reference's tie-breaking out of the comparison.
    logits = logits + np.arange(logits.size, dtype=np.float32) * 1e-3
    got = _probs_jit(jnp.asarray(logits), SamplingParams.create(temperature, top_k, top_p))
    np.testing.assert_allclose(got, _reference(logits, temperature, top_k, top_p), atol=1e-5)


def test_greedy_is_one_hot_on_first_argmax():
    logits = jnp.array([[0.5, 2.0, 2.0, -1.0]])
    probs = probs_from_logits(logits, SamplingParams.create(temperature=0.0, top_k=1, top_p=0.1))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_and_top_p_keep_expected_support():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    probs = probs_from_logits(logits, SamplingParams.create(top_k=2))
    np.testing.assert_allclose(probs, [0.625, 0.375, 0.0, 0.0], rtol=1e-6)
    probs = probs_from_logits(logits, SamplingParams.create(top_p=0.8))
    np.testing.assert_allclose(probs, [0.625, 0.375, 0.0, 0.0], rtol=1e-6)
    probs = probs_from_logits(logits, SamplingParams.create(top_p=0.81))
    np.testing.assert_allclose(probs, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], rtol=1e-6)


def test_per_row_knobs_in_one_batch():
    logits = jnp.tile(jnp.array([[1.0, 2.0, 3.0]]), (3, 1))
    params = SamplingParams.create(temperature=jnp.array([0.0, 1.0, 2.0]), top_k=0, top_p=1.0)
    probs = probs_from_logits(logits, params)
    assert probs[0].tolist() == [0.0, 0.0, 1.0]
    np.testing.assert_allclose(probs[1], jax.nn.softmax(logits[1]), rtol=1e-6)
    np.testing.assert_allclose(probs[2], jax.nn.softmax(logits[2] / 2), rtol=1e-6)


def test_knobs_are_traced_not_static():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(logits, params):
        return probs_from_logits(logits, params)

    logits = jnp.zeros((2, 8))
    for t, k, p in [(0.0, 0, 1.0), (0.7, 3, 0.9), (1.5, 8, 0.2)]:
        f(logits, SamplingParams.create(t, k, p))
    chex.clear_trace_counter()


def test_sample_never_draws_zero_probability_tokens():
    probs = jnp.array([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    draws = sample(jax.random.PRNGKey(0), jnp.broadcast_to(probs, (5000, 2, 4)))
    assert set(np.unique(draws[:, 0]).tolist()) == {1, 3}
    assert (draws[:, 1] == 2).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.1), "temperature must be"),
        (dict(temperature=float("nan")), "temperature must be"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(top_k=2.5), "whole number"),
        (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
        (dict(temperature=jnp.array([1.0, -1.0])), "temperature must be"),
    ],
)
def test_bad_knobs_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.create(**kwargs)


def test_bad_knobs_are_caught_even_when_built_by_hand():
    params = SamplingParams(jnp.float32(1.0), jnp.int32(0), jnp.float32(0.0))
    with pytest.raises(ValueError, match="top_p"):
        probs_from_logits(jnp.zeros(4), params)


def test_check_distribution():
    check_distribution(jnp.array([[0.25, 0.75]]))
    with pytest.raises(ValueError, match="sum to 1"):
        check_distribution(jnp.array([[0.25, 0.5]]), "p")
    with pytest.raises(ValueError, match="NaN"):
        check_distribution(jnp.array([[jnp.nan, 1.0]]))


def test_sample_logits_greedy_shortcut_and_sampled_path():
    from jspec.core.sampling import sample_logits

    logits = jax.random.normal(jax.random.PRNGKey(0), (6, 40))
    key = jax.random.PRNGKey(1)
    greedy = sample_logits(key, logits, SamplingParams.greedy())
    assert greedy.tolist() == jnp.argmax(logits, -1).tolist()
    params = SamplingParams.create(temperature=jnp.array([0.0, 1, 1, 1, 1, 1]), top_k=5)
    mixed = sample_logits(key, logits, params)
    assert mixed.tolist() == sample(key, probs_from_logits(logits, params)).tolist()
    assert int(mixed[0]) == int(jnp.argmax(logits[0]))
