"""Lookahead decoding: the window's mask and the pool by hand, greedy equality with plain decoding,
the target's distribution at T = 1 (with a negative control), and the inputs refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stats_util import LEVEL, sampled_p_value

from jspec.drafters import Context, Feedback, LookaheadDecoding
from jspec.drafters.lookahead import PoolState, window_mask
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.methods import make_drafter
from jspec.models.tiny import peaked_model, tiny_model

V = 97
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


def test_window_mask_is_the_papers():
    """W = 3 columns, 2 levels. Level 0 is a causal row; (1, i) sees level 0 up to column i and itself."""
    # columns: pending, (0,0) (0,1) (0,2) (1,0) (1,1) (1,2)
    want = np.array([
        [1, 1, 0, 0, 0, 0, 0],  # (0, 0)
        [1, 1, 1, 0, 0, 0, 0],  # (0, 1)
        [1, 1, 1, 1, 0, 0, 0],  # (0, 2)
        [1, 1, 0, 0, 1, 0, 0],  # (1, 0)
        [1, 1, 1, 0, 0, 1, 0],  # (1, 1)
        [1, 1, 1, 1, 0, 0, 1],  # (1, 2)
    ], bool)  # fmt: skip
    np.testing.assert_array_equal(window_mask(3, 2), want)
    # three levels: (2, 1) sees level 0's columns 0..1 and its own column's levels 1 and 2
    row = window_mask(2, 3)[2 * 2 + 1]
    np.testing.assert_array_equal(row, [1, 1, 1, 0, 1, 0, 1])


def _state(window, pool_size=3, steps=1):
    b = 1
    lv = len(window)
    return PoolState(
        window=jnp.asarray([window], jnp.int32),
        keys=jnp.full((b, pool_size), -1, jnp.int32),
        grams=jnp.zeros((b, pool_size, lv), jnp.int32),
        write=jnp.zeros((b,), jnp.int32),
        steps=jnp.full((b,), steps, jnp.int32),
    )


def _feedback(outputs):
    """Logits whose argmax at each window token (level-major) is ``outputs``."""
    tokens = jnp.asarray([np.ravel(outputs)], jnp.int32)
    return Feedback(jnp.zeros((1,), jnp.int32), (), jax.nn.one_hot(tokens, V) * 10.0)


def _pool(state):
    keys, grams = np.asarray(state.keys[0]), np.asarray(state.grams[0])
    return [(int(k), tuple(int(t) for t in g)) for k, g in zip(keys, grams, strict=True)]


def test_pool_and_window_after_steps_by_hand():
    """W = 2, N = 3 (levels 0 and 1), pool of 3. Each step stores (l0[i], l1[i], top output[i]) per
    column, skips an n-gram it holds, replaces the oldest when full; the window shifts one level."""
    la = LookaheadDecoding(window=2, level=3, guesses=2, pool_size=3, prompt_ngrams=False, output_ngrams=False)
    ctx = Context(jnp.zeros((1, 8), jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32))
    s = _state([[1, 2], [3, 4]], steps=0)
    s = la.commit(s, ctx, _feedback([[0, 0], [5, 6]]))  # not ripe yet: level 1 was a guess from the prompt
    assert _pool(s) == [(-1, (0, 0))] * 3
    np.testing.assert_array_equal(s.window[0], [[3, 4], [5, 6]])
    s = la.commit(s, ctx, _feedback([[0, 0], [7, 8]]))
    assert _pool(s) == [(3, (5, 7)), (4, (6, 8)), (-1, (0, 0))]
    np.testing.assert_array_equal(s.window[0], [[5, 6], [7, 8]])
    s = la.commit(s, ctx, _feedback([[0, 0], [9, 9]]))  # (5, 7, 9) new; (6, 8, 9) new: the pool is full
    assert _pool(s) == [(6, (8, 9)), (4, (6, 8)), (5, (7, 9))]
    s = PoolState(jnp.asarray([[[5, 6], [7, 8]]]), s.keys, s.grams, s.write, s.steps)
    s = la.commit(s, ctx, _feedback([[0, 0], [9, 9]]))  # both held already: nothing changes
    assert _pool(s) == [(6, (8, 9)), (4, (6, 8)), (5, (7, 9))]
    # lookup: the latest continuations of the pending token, merged into a trie
    s = PoolState(s.window, jnp.asarray([[6, 6, 5]]), jnp.asarray([[[8, 9], [8, 1], [7, 9]]]), s.write, s.steps)
    ctx = Context(jnp.asarray([[6, 0, 0]], jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32))
    proposal, _ = la.propose(s, ctx, jax.random.key(0), None)
    # write is 1 after three inserts and one replacement: slot 0 is the latest, then slot 1 ... here (8, 9) first
    np.testing.assert_array_equal(proposal.tokens[0], [6, 8, 9, 8, 1])
    np.testing.assert_array_equal(proposal.parents[0], [0, 0, 1, 0, 1])  # (8, 1) hangs below the first 8
    np.testing.assert_array_equal(proposal.used[0], [True, True, True, False, True])
    np.testing.assert_array_equal(proposal.depths[0], [0, 1, 2, 1, 2])
    assert bool(proposal.has_draft[0])


def test_prompt_ngrams_seed_the_pool():
    la = LookaheadDecoding(window=2, level=3, guesses=2, pool_size=8)
    prompts = jnp.asarray([[4, 5, 6, 4, 5, 7]], jnp.int32)
    history = jnp.zeros((1, 12), jnp.int32).at[:, :6].set(prompts).at[:, 6].set(4)  # the pending token: 4
    state = la.init(prompts, Context(history, jnp.asarray([7]), jnp.asarray([6])), 16, None, ())
    held = [entry for entry in _pool(state) if entry[0] >= 0]
    assert held == [(4, (5, 6)), (5, (6, 4)), (6, (4, 5)), (4, (5, 7)), (5, (7, 4))]


def test_the_new_texts_ngrams_join_the_pool():
    """Text 1 2 3 4 5 6 with two drafts accepted and 6 the new pending token: the n-grams ending in
    4, 5 and 6 join (N = 3), nothing older; the window's n-grams wait until its levels are ripe."""
    la = LookaheadDecoding(window=1, level=3, guesses=1, pool_size=8, prompt_ngrams=False)
    history = jnp.asarray([[1, 2, 3, 4, 5, 6, 0, 0]], jnp.int32)
    ctx = Context(history, jnp.asarray([6]), jnp.asarray([5]))
    s = _state([[9], [9]], pool_size=8, steps=0)
    feedback = Feedback(jnp.asarray([2]), (), jax.nn.one_hot(jnp.asarray([[9, 9]]), V))
    s = la.commit(s, ctx, feedback)
    assert [e for e in _pool(s) if e[0] >= 0] == [(2, (3, 4)), (3, (4, 5)), (4, (5, 6))]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=0)


@pytest.mark.parametrize(
    "knobs", [{}, {"window": 2, "level": 4, "guesses": 4, "pool_size": 8, "prompt_ngrams": False}], ids=str
)
def test_lookahead_greedy_equals_plain_greedy(target, knobs):
    plain = Decoder(target).generate(PROMPTS, 40)
    result = SpeculativeDecoder(target, LookaheadDecoding(**knobs)).generate(PROMPTS, 40)
    assert result.tokens == plain.tokens
    assert sum(result.accept_hist[1:]) > 0  # candidates were accepted: the pool worked


def test_lookahead_sampling_has_the_target_distribution_with_negative_control(monkeypatch):
    """T = 1, 4000 rows, a vocabulary of 8 (so the pool holds continuations of most tokens): tokens
    against plain sampling's, with the real tree verifier and with one that samples the node's
    distribution instead of the residual after a rejection (which must fail)."""
    from test_tree import _verify_without_residual

    import jspec.drafters.base
    from jspec.core.sampling import SamplingParams

    prompts = [np.random.default_rng(0).integers(0, 8, 24).tolist()] * 4000
    params = SamplingParams.create(temperature=1.0)
    target = peaked_model(seed=5, vocab_size=8)
    plain = np.array(Decoder(target).generate(prompts, 5, params, seed=1).tokens)
    drafter = LookaheadDecoding(window=2, level=3, guesses=2, pool_size=32)

    def p_value():
        result = SpeculativeDecoder(target, drafter).generate(prompts, 5, params, seed=2)
        assert sum(result.accept_hist[1:]) > 1000 and result.accept_hist[0] > 1000  # accepts and rejects both
        return sampled_p_value(np.array(result.tokens), plain, 8)

    assert p_value() > LEVEL
    broken = jax.vmap(_verify_without_residual, in_axes=(0, 0, 0, None, 0, 0, None))
    monkeypatch.setattr(jspec.drafters.base, "verify_tree_batch", broken)  # what TreeProposal.verify calls
    jax.clear_caches()  # the loop traced with the real verifier is cached
    assert p_value() < LEVEL
    jax.clear_caches()


def test_lookahead_options_are_refused_clearly(target):
    for knobs, message in [
        ({"window": 0}, "window must be a whole number >= 1"),
        ({"level": 1}, "level must be a whole number >= 2"),
        ({"guesses": 0}, "guesses must be a whole number >= 1"),
        ({"pool_size": 0}, "pool_size must be a whole number >= 1"),
        ({"guesses": 9, "pool_size": 4}, "cannot exceed the pool"),
    ]:
        with pytest.raises(ValueError, match=message):
            LookaheadDecoding(**knobs)
    with pytest.raises(ValueError, match="feeds 1415 tokens per step, more than the target's context"):
        SpeculativeDecoder(target, LookaheadDecoding(window=200, level=8, guesses=2))
    takes = "method 'lookahead' takes window, level, guesses, pool_size, prompt_ngrams; not "
    with pytest.raises(ValueError, match=takes + "tree"):
        make_drafter("lookahead", target, tree="2,2")
    with pytest.raises(ValueError, match=takes + "num_draft"):
        make_drafter("lookahead", target, num_draft=3)
    with pytest.raises(ValueError, match="method 'ngram' takes num_draft, tree, ngram_min, ngram_max; not window"):
        make_drafter("ngram", target, lookahead={"window": 4})
    assert make_drafter("lookahead", target, lookahead={"window": 5}).window == 5


def test_lookahead_command_line_refuses_bad_knobs_before_loading(capsys):
    from jspec.cli.main import main

    base = ["generate", "--prompt", "Hi", "--model", "no-such-model"]  # never loaded: refused first
    assert main([*base, "--method", "lookahead", "--lookahead-level", "1"]) == 2
    assert "level must be a whole number >= 2" in capsys.readouterr().err
    assert main([*base, "--method", "ngram", "--lookahead-window", "3"]) == 2
    assert "--lookahead-window is an option of lookahead; none of ngram takes it" in capsys.readouterr().err
    assert main([*base, "--method", "lookahead", "--num-draft", "3"]) == 2
    err = capsys.readouterr().err
    assert "--num-draft is an option of ngram, draft, eagle3, eagle1, medusa; none of lookahead" in err
