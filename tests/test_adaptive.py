"""The adaptive loop: plain steps where speculation does not pay, probes, drafters kept in step, exactness."""

import jax
import numpy as np
import pytest
from tiny import peaked_model, tiny_model

from jspec.adaptive import Adaptive, StepCosts
from jspec.decode import Decoder
from jspec.drafters import DraftModel, PromptLookup
from jspec.drafters.draft_model import DraftModel as DraftModelClass
from jspec.engine import SpeculativeDecoder

V = 97


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=0)


def _prompts():
    rng = np.random.default_rng(0)
    base = rng.integers(4, V, 6).tolist()
    return [base * 3, rng.integers(4, V, 9).tolist(), base[:4]]


def test_speculation_that_cannot_pay_falls_back_to_plain_steps(target):
    prompts = _prompts()
    plain = Decoder(target).generate(prompts, 24).tokens
    engine = SpeculativeDecoder(target, PromptLookup(num_draft=3), adaptive=Adaptive(probe_every=8),
                                costs=StepCosts.create(speculative=50.0))  # fmt: skip
    got = engine.generate(prompts, 24)
    assert got.tokens == plain
    assert got.fallback_steps > 0 and got.verify_steps <= 1 + got.fallback_steps // 8  # the first step, then probes
    # Probes that keep failing come ever more rarely (without the doubling: a probe every 2 steps, 8 or more).
    sparse = SpeculativeDecoder(target, PromptLookup(num_draft=3), adaptive=Adaptive(probe_every=2, prior=0.0),
                                costs=StepCosts.create(speculative=50.0)).generate(prompts, 24)  # fmt: skip
    assert sparse.tokens == plain and sparse.verify_steps <= 4  # waits of 2, 4, 8, 16: 30 steps, 4 probes at most
    assert got.stats()["fallback_steps"] == got.fallback_steps


def test_free_speculation_is_the_fixed_loop(target):
    prompts = _prompts()
    fixed = SpeculativeDecoder(target, PromptLookup(num_draft=3)).generate(prompts, 24)
    adaptive = SpeculativeDecoder(target, PromptLookup(num_draft=3), adaptive=Adaptive(),
                                  costs=StepCosts.create(speculative=1.0)).generate(prompts, 24)  # fmt: skip
    assert adaptive.tokens == fixed.tokens and adaptive.fallback_steps == 0
    assert (adaptive.verify_steps, adaptive.accept_hist) == (fixed.verify_steps, fixed.accept_hist)


def test_a_draft_model_stays_in_step_through_fallback_steps(target, monkeypatch):
    """The target drafting for itself: every draft is accepted while its cache holds what the target
    committed, plain steps without a proposal included. Negative control: the consumed token dropped."""
    prompts = _prompts()
    plain = Decoder(target).generate(prompts, 30).tokens
    drafter = DraftModel.from_model(target, target, num_draft=3)
    policy, costs = Adaptive(probe_every=2, prior=0.0), StepCosts.create(speculative=50.0)
    got = SpeculativeDecoder(target, drafter, adaptive=policy, costs=costs).generate(prompts, 30)
    assert got.tokens == plain and got.fallback_steps >= 2 * (got.verify_steps - 1)
    assert got.acceptance_by_position() == [1.0, 1.0, 1.0]

    monkeypatch.setattr(DraftModelClass, "_catch_up_plain_step", lambda self, state, ctx: state)
    jax.clear_caches()
    try:
        broken = SpeculativeDecoder(target, drafter, adaptive=policy, costs=costs).generate(prompts, 30)
    finally:
        jax.clear_caches()
    assert broken.tokens == plain and broken.acceptance_by_position() != [1.0, 1.0, 1.0]


def test_sampled_output_of_an_adaptive_loop_has_the_target_distribution_with_negative_control():
    """Temperature 1, 6000 rows, a step schedule of speculation, a fallback and speculation again (costs
    that make speculation marginal): tokens 2-4 distributed as plain sampling's."""
    from scipy import stats
    from stats_util import LEVEL

    from jspec.check import two_sample_chi2, verify_chain_without_residual
    from jspec.sampling import SamplingParams
    from jspec.verify import verify_chain

    prompts = [[7, 8, 9, 10]] * 6000
    params = SamplingParams.create(temperature=1.0)
    target = peaked_model(seed=5)
    plain = np.array(Decoder(target).generate(prompts, 4, params, seed=1).tokens)
    drafter = DraftModel.from_model(peaked_model(seed=6, num_layers=1), target, num_draft=2)

    def p_value(verifier):
        policy = Adaptive(probe_every=1, max_probe_every=1)  # speculate, fall back, speculate
        engine = SpeculativeDecoder(target, drafter, verifier=jax.vmap(verifier), adaptive=policy,
                                    costs=StepCosts.create(speculative=2.5))  # fmt: skip
        result = engine.generate(prompts, 4, params, seed=2)
        assert result.fallback_steps == 1 and result.verify_steps == 2
        spec = np.array(result.tokens)
        chi2, dof = 0.0, 0
        for j in (1, 2, 3):
            c, d = two_sample_chi2(np.bincount(spec[:, j], minlength=V), np.bincount(plain[:, j], minlength=V))
            chi2, dof = chi2 + c, dof + d
        return stats.chi2.sf(chi2, dof)

    assert p_value(verify_chain) > LEVEL
    assert p_value(verify_chain_without_residual) < LEVEL


def test_adaptive_options_are_checked(target):
    with pytest.raises(ValueError, match="both adaptive"):
        SpeculativeDecoder(target, PromptLookup(num_draft=2), adaptive=Adaptive())
    with pytest.raises(ValueError, match="both adaptive"):
        SpeculativeDecoder(target, PromptLookup(num_draft=2), costs=StepCosts.create(2.0))
    with pytest.raises(ValueError, match="probe_every"):
        Adaptive(probe_every=0)
    with pytest.raises(ValueError, match="max_probe_every"):
        Adaptive(probe_every=8, max_probe_every=4)
    with pytest.raises(ValueError, match="step costs must be > 0"):
        StepCosts.create(0.0)


@pytest.mark.parametrize("kind", ["eagle_dynamic_tree", "draft_model_tree"])
def test_tree_drafters_through_fallback_steps_keep_plain_greedy_output(target, kind):
    from flax import nnx

    from jspec.drafters import EagleDrafter
    from jspec.heads import DraftHead, HeadConfig, draft_vocabulary
    from jspec.tree import DynamicTreeSpec, StaticTree

    if kind == "eagle_dynamic_tree":
        head = DraftHead(HeadConfig.for_target(target.config, "eagle3", draft_vocab_size=40), rngs=nnx.Rngs(1))
        head.attach_target(target, draft_vocabulary(np.arange(V)[::-1], 40))
        drafter = EagleDrafter.from_head(head, target, tree=DynamicTreeSpec())
    else:
        drafter = DraftModel.from_model(target, target, tree=StaticTree.from_branching([2, 2]))
    prompts = _prompts()
    engine = SpeculativeDecoder(target, drafter, adaptive=Adaptive(probe_every=2, prior=0.0),
                                costs=StepCosts.create(speculative=50.0))  # fmt: skip
    got = engine.generate(prompts, 24)
    assert got.tokens == Decoder(target).generate(prompts, 24).tokens and got.fallback_steps > got.verify_steps
    if kind == "draft_model_tree":  # the target drafting: every path accepted to its leaf while in step
        assert got.acceptance_by_position() == [1.0, 1.0]


def test_an_eagle_head_catches_up_on_deferred_fallback_steps_exactly(target):
    """Three fallback steps kept in the head's backlog, then run through it at the next proposal, leave
    the head where one commit of the same three tokens leaves it. Negative control: not caught up."""
    import jax.numpy as jnp
    from flax import nnx

    from jspec.drafters import Context, EagleDrafter, Feedback
    from jspec.heads import DraftHead, HeadConfig, draft_vocabulary
    from jspec.sampling import SamplingParams

    head = DraftHead(HeadConfig.for_target(target.config, "eagle3", draft_vocab_size=40), rngs=nnx.Rngs(1))
    head.attach_target(target, draft_vocabulary(np.arange(V)[::-1], 40))
    drafter = EagleDrafter.from_head(head, target, num_draft=3)
    text, capacity, greedy = [11, 12, 13, 14, 15, 40, 41, 42, 43], 32, SamplingParams.greedy()
    hidden = target(jnp.array([text]), jnp.arange(len(text))[None], target.init_cache(1, capacity),
                    hidden_layers=drafter.hidden_layers).hidden_states  # fmt: skip

    def ctx(length):  # the first `length` tokens of the text, the last one pending
        history = jnp.zeros((1, capacity), jnp.int32).at[0, :length].set(jnp.array(text[:length]))
        return Context(history, jnp.array([length]), jnp.array([length - 1]))

    start = drafter.init(jnp.array([text[:5]]), ctx(6), capacity, greedy, tuple(h[:, :5] for h in hidden))
    deferred = start
    for i in range(3):  # the target consumed the token at position 5 + i
        feedback = Feedback(jnp.zeros((1,), jnp.int32), tuple(h[:, 5 + i : 6 + i] for h in hidden), proposed=False)
        deferred = drafter.commit(deferred, ctx(7 + i), feedback)
    assert int(deferred.backlog_len[0]) == 3
    at_once = drafter.commit(start, ctx(9), Feedback(jnp.array([2]), tuple(h[:, 5:8] for h in hidden)))
    caught_up = drafter._flushed(nnx.merge(drafter.graphdef, drafter.weights), deferred, ctx(9))
    np.testing.assert_allclose(caught_up.logits, at_once.logits, atol=1e-5)
    np.testing.assert_allclose(caught_up.hidden, at_once.hidden, atol=1e-5)
    key = jax.random.PRNGKey(0)
    assert (
        drafter.propose(deferred, ctx(9), key, greedy)[0].tokens
        == drafter.propose(at_once, ctx(9), key, greedy)[0].tokens
    ).all()
    assert not np.allclose(deferred.logits, at_once.logits, atol=1e-5)  # before catching up, the head is behind
