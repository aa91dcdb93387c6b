"""Exactness of the chain verifier: analytic identity, statistics, edge cases, batching, greedy."""

import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from stats_util import LEVEL, gof_p_value

from jspec import SamplingParams, probs_from_logits, sample
from jspec.analysis.check import verify_chain_without_residual
from jspec.core.verify import (
    acceptance_probability,
    residual_distribution,
    verify_chain,
    verify_chain_batch,
    verify_chain_batch_logits,
    verify_chain_logits,
)

V = 12


def _normalize(x):
    x = np.asarray(x, np.float64)
    return (x / x.sum(-1, keepdims=True)).astype(np.float32)


def _random_dist(rng, shape, zero_frac=0.0, keep=0):
    x = rng.gamma(0.7, size=shape)
    if zero_frac:
        zero = rng.random(shape) < zero_frac
        zero[..., keep] = False
        x = np.where(zero, 0.0, x)
    return _normalize(x)


# ---------------------------------------------------------------- analytic identity

weights = hnp.arrays(
    np.float64,
    st.integers(2, 10),
    elements=st.one_of(st.just(0.0), st.floats(1e-3, 1.0)),
)


def _emission(p, q, residual_fn):
    """P(emit x) of one speculative position: accept d ~ p, else draw from the residual."""
    a = np.asarray(acceptance_probability(jnp.asarray(p), jnp.asarray(q)), np.float64)
    accept = p * a
    return accept + (1.0 - accept.sum()) * np.asarray(residual_fn(jnp.asarray(q), jnp.asarray(p)), np.float64)


@given(weights, st.data())
def test_one_position_emits_exactly_q(raw_p, data):
    """p(x) min(1, q/p) + P(reject) residual(x) = q(x), for any p and q, zeros included."""
    raw_q = data.draw(hnp.arrays(np.float64, raw_p.shape, elements=st.one_of(st.just(0.0), st.floats(1e-3, 1.0))))
    if raw_p.sum() == 0 or raw_q.sum() == 0:
        return
    p, q = raw_p / raw_p.sum(), raw_q / raw_q.sum()
    np.testing.assert_allclose(
        _emission(p.astype(np.float32), q.astype(np.float32), residual_distribution), q, atol=2e-6
    )


def test_identity_negative_control():
    """Skipping the residual (drawing from q on rejection) breaks the identity."""
    p = np.array([0.7, 0.2, 0.1], np.float32)
    q = np.array([0.2, 0.3, 0.5], np.float32)
    wrong = _emission(p, q, lambda q_, p_: q_)
    assert np.abs(wrong - q).max() > 0.1
    np.testing.assert_allclose(_emission(p, q, residual_distribution), q, atol=1e-6)


def test_acceptance_rule_values():
    p = jnp.array([0.5, 0.2, 0.0, 0.0, 0.3])
    q = jnp.array([0.25, 0.6, 0.4, 0.0, 0.0])
    np.testing.assert_allclose(acceptance_probability(p, q), [0.5, 1.0, 0.0, 0.0, 0.0])  # p(d) = 0: a placeholder


def test_residual_all_zero_falls_back_to_q():
    q = jnp.array([0.1, 0.2, 0.7])
    np.testing.assert_allclose(residual_distribution(q, q), q)
    np.testing.assert_allclose(residual_distribution(q, jnp.array([0.0, 0.5, 0.5])), [1 / 3, 0.0, 2 / 3], rtol=1e-6)


# ---------------------------------------------------------------- statistics of the real verifier


def _run(p, q, steps, seed, verifier=verify_chain, drafts=None):
    """Many independent verify steps on fixed (p, q); drafts ~ p unless given."""
    n = p.shape[0]
    key = jax.random.PRNGKey(seed)
    k_draft, k_verify = jax.random.split(key)
    pb = jnp.broadcast_to(p, (steps, *p.shape))
    qb = jnp.broadcast_to(q, (steps, *q.shape))
    d = sample(k_draft, pb) if drafts is None else jnp.broadcast_to(drafts, (steps, n))
    out = jax.jit(jax.vmap(verifier))(d, pb, qb, jax.random.split(k_verify, steps))
    return np.asarray(out.tokens), np.asarray(out.num_accepted)


def _position_p_values(tokens, num_accepted, q):
    n1, vocab = q.shape
    out = []
    for j in range(n1):
        emitted = tokens[num_accepted >= j, j]
        if emitted.size >= 200:
            out.append(gof_p_value(np.bincount(emitted, minlength=vocab), q[j]))
    return out


def _accept_count_p_value(num_accepted, p, q):
    """The number accepted follows P(k) = prod_{i<k} beta_i (1 - beta_k), beta = sum min(p, q)."""
    beta = np.minimum(p, q[: p.shape[0]]).sum(-1).astype(np.float64)
    n = p.shape[0]
    probs = np.array([np.prod(beta[:k]) * (1 - beta[k] if k < n else 1.0) for k in range(n + 1)])
    return gof_p_value(np.bincount(num_accepted, minlength=n + 1), probs / probs.sum())


CASES = {
    "generic": dict(p_zero=0.0, q_zero=0.0),
    "zeros_in_both": dict(p_zero=0.4, q_zero=0.3),
    "zeros_in_p_where_q_positive": dict(p_zero=0.6, q_zero=0.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n", [1, 3])
def test_every_position_is_distributed_as_q(case, n):
    rng = np.random.default_rng(zlib.crc32(f"{case}/{n}".encode()))  # hash() of a str changes per process
    q = _random_dist(rng, (n + 1, V), CASES[case]["q_zero"], keep=0)
    p = _random_dist(rng, (n, V), CASES[case]["p_zero"], keep=1)
    tokens, num_accepted = _run(jnp.asarray(p), jnp.asarray(q), 30_000, seed=n)
    p_values = _position_p_values(tokens, num_accepted, q)
    assert len(p_values) >= 2 if n > 1 else len(p_values) == 2
    assert min(p_values) > LEVEL, p_values
    assert _accept_count_p_value(num_accepted, p, q) > LEVEL


def test_negative_control_verifier_without_residual_fails():
    rng = np.random.default_rng(0)
    q = _random_dist(rng, (4, V))
    p = _random_dist(rng, (3, V))
    tokens, num_accepted = _run(jnp.asarray(p), jnp.asarray(q), 30_000, seed=3, verifier=verify_chain_without_residual)
    assert min(_position_p_values(tokens, num_accepted, q)) < LEVEL


def test_q_equals_p_accepts_everything():
    rng = np.random.default_rng(1)
    q = _random_dist(rng, (4, V))
    tokens, num_accepted = _run(jnp.asarray(q[:3]), jnp.asarray(q), 20_000, seed=0)
    assert (num_accepted == 3).all()
    assert gof_p_value(np.bincount(tokens[:, 3], minlength=V), q[3]) > LEVEL


def test_disjoint_supports_accept_nothing():
    q = np.zeros((3, V), np.float32)
    q[:, : V // 2] = 1.0
    p = np.zeros((2, V), np.float32)
    p[:, V // 2 :] = 1.0
    q, p = _normalize(q), _normalize(p)
    tokens, num_accepted = _run(jnp.asarray(p), jnp.asarray(q), 20_000, seed=0)
    assert (num_accepted == 0).all()
    assert gof_p_value(np.bincount(tokens[:, 0], minlength=V), q[0]) > LEVEL


def test_one_hot_drafts():
    """A deterministic drafter: p is one-hot on its pick, the output is still q."""
    rng = np.random.default_rng(2)
    q = _random_dist(rng, (3, V))
    drafts = np.array([int(np.argmax(q[0])), 5])
    p = np.eye(V, dtype=np.float32)[drafts]
    tokens, num_accepted = _run(jnp.asarray(p), jnp.asarray(q), 30_000, seed=1, drafts=jnp.asarray(drafts))
    assert abs(np.mean(num_accepted >= 1) - q[0, drafts[0]]) < 0.01
    assert min(_position_p_values(tokens, num_accepted, q)) > LEVEL


def _run_deterministic(drafts, q, steps, seed):
    """verify_chain with ``draft_probs=None`` (no one-hot rows) on fixed drafts, many independent steps."""
    qb = jnp.broadcast_to(q, (steps, *q.shape))
    db = jnp.broadcast_to(drafts, (steps, drafts.shape[0]))
    run = jax.jit(jax.vmap(lambda d, q, k: verify_chain(d, None, q, k)))
    out = run(db, qb, jax.random.split(jax.random.PRNGKey(seed), steps))
    return np.asarray(out.tokens), np.asarray(out.num_accepted)


def test_deterministic_drafts_need_no_one_hot_rows(monkeypatch):
    """draft_probs=None is the one-hot rule without the [N, V] rows: the same verdicts on the same
    keys, every position distributed as q. Negative control: the rejected token left in the residual."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(_random_dist(rng, (3, V)))
    drafts = jnp.array([int(np.argmax(q[0])), 5])
    keys = jax.random.split(jax.random.PRNGKey(4), 64)
    one_hot = verify_chain_batch(jnp.tile(drafts, (64, 1)), jnp.tile(jnp.eye(V)[drafts], (64, 1, 1)),
                                 jnp.tile(q, (64, 1, 1)), keys)  # fmt: skip
    none = verify_chain_batch(jnp.tile(drafts, (64, 1)), None, jnp.tile(q, (64, 1, 1)), keys)
    np.testing.assert_array_equal(np.asarray(none.tokens), np.asarray(one_hot.tokens))
    tokens, num_accepted = _run_deterministic(drafts, q, 30_000, seed=1)
    assert abs(np.mean(num_accepted >= 1) - float(q[0, drafts[0]])) < 0.01
    assert min(_position_p_values(tokens, num_accepted, np.asarray(q))) > LEVEL
    monkeypatch.setattr("jspec.core.verify.residual_distribution", lambda q, p: q)
    tokens, num_accepted = _run_deterministic(drafts, q, 30_000, seed=1)
    assert min(_position_p_values(tokens, num_accepted, np.asarray(q))) < LEVEL


def test_logits_verifiers_equal_the_probability_ones_and_trace_once():
    rng = np.random.default_rng(3)
    b, n = 16, 3
    target_logits = jnp.asarray(rng.normal(size=(b, n + 1, V)) * 2, jnp.float32)
    draft_logits = jnp.asarray(rng.normal(size=(b, n, V)) * 2, jnp.float32)
    drafts = jnp.asarray(rng.integers(0, V, (b, n)), jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(0), b)
    sampling = SamplingParams.create(temperature=0.7, top_k=8, top_p=0.9)
    p, q = probs_from_logits(draft_logits, sampling), probs_from_logits(target_logits, sampling)
    from_logits = verify_chain_batch_logits(drafts, draft_logits, target_logits, keys, sampling)
    want = verify_chain_batch(drafts, p, q, keys)
    np.testing.assert_array_equal(np.asarray(from_logits.tokens), np.asarray(want.tokens))
    one = verify_chain_logits(drafts[0], draft_logits[0], target_logits[0], keys[0], sampling)
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(want.tokens[0]))
    deterministic = verify_chain_batch_logits(drafts, None, target_logits, keys, sampling)
    np.testing.assert_array_equal(
        np.asarray(deterministic.tokens), np.asarray(verify_chain_batch(drafts, None, q, keys).tokens)
    )
    import jspec.core.verify

    compiled = jspec.core.verify._verify_chain_batch_logits._cache_size()
    verify_chain_batch_logits(drafts, draft_logits, target_logits + 1.0, keys, SamplingParams.create(temperature=1.3))
    assert jspec.core.verify._verify_chain_batch_logits._cache_size() == compiled  # new values, no new trace
    with pytest.raises(ValueError, match="target_logits must be"):
        verify_chain_batch_logits(drafts, draft_logits, target_logits[:, :n], keys)


def test_emitted_tokens_layout_and_padding():
    q = np.eye(V, dtype=np.float32)[[3, 4, 9]]
    p = np.eye(V, dtype=np.float32)[[3, 7]]
    out = verify_chain(jnp.array([3, 7]), jnp.asarray(p), jnp.asarray(q), jax.random.PRNGKey(0), pad_id=-1)
    assert int(out.num_accepted) == 1 and int(out.num_emitted) == 2
    assert out.tokens.tolist() == [3, 4, -1]
    assert out.accepted.tolist() == [True, False]


# ---------------------------------------------------------------- batch


def test_batched_rows_are_independent_and_match_single_rows():
    rng = np.random.default_rng(3)
    n = 4
    q = _random_dist(rng, (3, n + 1, V))
    # Row 0: p = q, accepts every draft. Row 1: drafts a token the target
    # gives probability 0, rejects at once. Row 2: anything in between.
    worst = np.argmin(q[1], -1)
    q[1] = _normalize(np.where(np.eye(V)[worst] > 0, 0.0, q[1]))
    p = np.stack([q[0, :n], np.eye(V, dtype=np.float32)[worst[:n]], _random_dist(rng, (n, V))])
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    drafts = np.stack([np.asarray(sample(k, jnp.asarray(pp))) for k, pp in zip(keys, p, strict=True)])
    batch = verify_chain_batch(jnp.asarray(drafts), jnp.asarray(p), jnp.asarray(q), keys)
    assert int(batch.num_accepted[0]) == n and int(batch.num_accepted[1]) == 0
    for b in range(3):
        single = verify_chain(jnp.asarray(drafts[b]), jnp.asarray(p[b]), jnp.asarray(q[b]), keys[b])
        assert batch.tokens[b].tolist() == single.tokens.tolist()
        assert int(batch.num_accepted[b]) == int(single.num_accepted)


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("draft_temperature", [0.0, 1.0])
def test_greedy_emits_exactly_the_target_argmax(draft_temperature):
    """Target at temperature 0: a draft is accepted iff it is the target's argmax."""
    rng = np.random.default_rng(4)
    b, n = 64, 5
    target_logits = rng.normal(size=(b, n + 1, V)).astype(np.float32)
    target_logits[:, :, 0] = target_logits[:, :, 1]  # ties: argmax takes the first
    argmax = target_logits.argmax(-1)
    hit = rng.random((b, n)) < 0.7
    drafts = np.where(hit, argmax[:, :n], rng.integers(0, V, (b, n))).astype(np.int32)
    draft_logits = rng.normal(size=(b, n, V)).astype(np.float32)
    draft_logits[np.arange(b)[:, None], np.arange(n), drafts] += 20.0
    q = probs_from_logits(target_logits, SamplingParams.greedy())
    p = probs_from_logits(draft_logits, SamplingParams.create(temperature=draft_temperature))
    out = verify_chain_batch(jnp.asarray(drafts), p, q, jax.random.split(jax.random.PRNGKey(0), b))
    matches = drafts == argmax[:, :n]
    want_accepted = np.where(matches.all(1), n, np.argmin(matches, 1))
    np.testing.assert_array_equal(out.num_accepted, want_accepted)
    for row in range(b):
        k = int(want_accepted[row]) + 1
        assert out.tokens[row, :k].tolist() == argmax[row, :k].tolist()


# ---------------------------------------------------------------- tracing


def test_one_trace_per_static_config():
    rng = np.random.default_rng(5)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(drafts, p, q, key):
        return verify_chain(drafts, p, q, key)

    for i in range(4):
        q = jnp.asarray(_random_dist(rng, (4, V)))
        p = jnp.asarray(_random_dist(rng, (3, V)))
        step(jnp.array([i, 1, 2]), p, q, jax.random.PRNGKey(i))
    chex.clear_trace_counter()


# ---------------------------------------------------------------- bad input


def _ok():
    q = jnp.full((3, V), 1.0 / V)
    return jnp.array([1, 2]), q[:2], q


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d, p, q: (d[:0], p[:0], q[:1]), "N >= 1"),
        (lambda d, p, q: (d, p[:1], q), "draft_probs must be"),
        (lambda d, p, q: (d, p, q[:2]), "target_probs must be"),
        (lambda d, p, q: (d, p[:, :5], q), "target_probs must be"),
        (lambda d, p, q: (d, p * 2, q), "sum to 1"),
        (lambda d, p, q: (d, p, q.at[0, 0].set(-0.5)), "negative"),
        (lambda d, p, q: (d, p, jnp.log(q)), "negative"),
        (lambda d, p, q: (d.at[0].set(V), p, q), "must lie in"),
        (lambda d, p, q: (d.astype(jnp.float32), p, q), "integers"),
        (lambda d, p, q: (d[None], p, q), "draft_tokens must be"),
    ],
)
def test_bad_input_raises_clear_value_error(mutate, message):
    d, p, q = mutate(*_ok())
    with pytest.raises(ValueError, match=message):
        verify_chain(d, p, q, jax.random.PRNGKey(0))


def test_batch_needs_one_key_per_row():
    d, p, q = _ok()
    with pytest.raises(ValueError, match="one key per row"):
        verify_chain_batch(d[None].repeat(3, 0), p[None].repeat(3, 0), q[None].repeat(3, 0), jax.random.PRNGKey(0))


# ---------------------------------------------------------------- rows that draft different lengths


def _with_wrong_bonus(draft_tokens, draft_probs, target_probs, key, num_drafts):
    """Broken on purpose: when a row's drafts all pass, it draws the next token from the residual
    against the draft slot after them (treating an empty slot as a rejected draft) instead of q."""
    v = verify_chain(draft_tokens, draft_probs, target_probs, key, num_drafts=num_drafts)
    k = v.num_accepted
    wrong = sample(jax.random.fold_in(key, 3), residual_distribution(target_probs[k], draft_probs[k]))
    bonus = (k == num_drafts) & (k < draft_tokens.shape[0])
    tokens = jnp.where(bonus & (jnp.arange(draft_tokens.shape[0] + 1) == k), wrong, v.tokens).astype(jnp.int32)
    return v.replace(tokens=tokens)


def test_a_row_with_fewer_drafts_is_verified_as_a_chain_of_its_length_with_negative_control():
    """Count 1 of N = 3: at most one draft accepted; after it, the bonus token ~ q[1] exactly, and
    every emitted token has the target's distribution. The wrong bonus (residual) must fail."""
    rng = np.random.default_rng(11)
    n, steps = 3, 40_000
    p, q = _normalize(rng.random((n, V)) ** 3), _normalize(rng.random((n + 1, V)) ** 3)
    key = jax.random.PRNGKey(4)
    drafts = sample(jax.random.fold_in(key, 1), jnp.broadcast_to(p, (steps, n, V)))
    counts = jnp.ones((steps,), jnp.int32)
    keys = jax.random.split(key, steps)

    def run(verifier):
        fn = jax.jit(jax.vmap(verifier))
        return fn(drafts, jnp.broadcast_to(p, (steps, n, V)), jnp.broadcast_to(q, (steps, n + 1, V)), keys, counts)

    good = verify_chain_batch(drafts, jnp.broadcast_to(p, (steps, n, V)), jnp.broadcast_to(q, (steps, n + 1, V)),
                              keys, num_drafts=counts)  # fmt: skip
    assert int(good.num_accepted.max()) == 1 and int(good.num_emitted.max()) == 2
    tokens, accepted = np.asarray(good.tokens), np.asarray(good.num_accepted)
    assert min(_position_p_values(tokens, accepted, q[:2])) > LEVEL
    bad = run(_with_wrong_bonus)
    bonus = np.asarray(bad.num_accepted) == 1
    assert gof_p_value(np.bincount(np.asarray(bad.tokens)[bonus, 1], minlength=V), q[1]) < LEVEL


def test_slots_past_a_row_s_count_are_never_accepted_and_zero_is_a_plain_step():
    """q is certain of every draft: without counts all 3 pass; with counts 0..3 exactly that many do,
    and the token after them comes from q at that position."""
    drafts = jnp.array([[4, 5, 6]] * 4, jnp.int32)
    q = np.full((4, 4, V), 1e-3, np.float32)
    for i, tok in enumerate([4, 5, 6, 7]):
        q[:, i, tok] = 1.0
    q = jnp.asarray(_normalize(q))
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    counts = jnp.arange(4, dtype=jnp.int32)
    v = verify_chain_batch(drafts, None, q, keys, num_drafts=counts)
    assert np.asarray(v.num_accepted).tolist() == [0, 1, 2, 3]
    assert [np.asarray(v.tokens)[i, i] for i in range(4)] == [4, 5, 6, 7]  # the bonus is q's token there
    assert np.asarray(verify_chain_batch(drafts, None, q, keys).num_accepted).tolist() == [3, 3, 3, 3]
    with pytest.raises(ValueError, match=r"num_drafts must be whole numbers in 0\.\.3"):
        verify_chain_batch(drafts, None, q, keys, num_drafts=jnp.array([0, 1, 2, 4]))
    with pytest.raises(ValueError, match=r"num_drafts must have shape \(4,\)"):
        verify_chain_batch(drafts, None, q, keys, num_drafts=jnp.array([1, 2]))
