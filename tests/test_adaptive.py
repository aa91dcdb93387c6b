"""The adaptive loop: plain steps where speculation does not pay, probes, drafters kept in step, exactness."""

import jax
import numpy as np
import pytest

from jspec.drafters import DraftModel, PromptLookup
from jspec.drafters.draft_model import DraftModel as DraftModelClass
from jspec.loop.adaptive import Adaptive, StepCosts
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.models.tiny import peaked_model, tiny_model

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


def _sampled_p_values(num_draft, policy, costs, check):
    """Temperature 1, 6000 rows, a peaked target and a one-layer drafter: the chi-square p-value of
    tokens 2-4 against plain sampling's, with the real verifier and with the one that skips the
    residual (the negative control); ``check(result)`` asserts the schedule exercised the path."""
    from stats_util import sampled_p_value

    from jspec.analysis.check import verify_chain_without_residual
    from jspec.core.sampling import SamplingParams
    from jspec.core.verify import verify_chain

    prompts = [[7, 8, 9, 10]] * 6000
    params = SamplingParams.create(temperature=1.0)
    target = peaked_model(seed=5)
    plain = np.array(Decoder(target).generate(prompts, 4, params, seed=1).tokens)
    drafter = DraftModel.from_model(peaked_model(seed=6, num_layers=1), target, num_draft=num_draft)

    def p_value(verifier):
        engine = SpeculativeDecoder(target, drafter, verifier=jax.vmap(verifier), adaptive=policy, costs=costs)
        result = engine.generate(prompts, 4, params, seed=2)
        check(result)
        return sampled_p_value(np.array(result.tokens), plain, V)

    return p_value(verify_chain), p_value(verify_chain_without_residual)


def test_sampled_output_of_an_adaptive_loop_has_the_target_distribution_with_negative_control():
    """A step schedule of speculation, a fallback and speculation again (costs that make speculation
    marginal): tokens 2-4 distributed as plain sampling's."""
    from stats_util import LEVEL

    def check(result):
        assert result.fallback_steps == 1 and result.verify_steps == 2

    policy = Adaptive(probe_every=1, max_probe_every=1)  # speculate, fall back, speculate
    good, broken = _sampled_p_values(2, policy, StepCosts.create(speculative=2.5), check)
    assert good > LEVEL and broken < LEVEL


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

    from jspec.core.tree import DynamicTreeSpec, StaticTree
    from jspec.drafters import EagleDrafter
    from jspec.heads.eagle import DraftHead, HeadConfig, draft_vocabulary

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

    from jspec.core.sampling import SamplingParams
    from jspec.drafters import Context, EagleDrafter, Feedback
    from jspec.heads.eagle import DraftHead, HeadConfig, draft_vocabulary

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


def test_the_width_with_most_expected_tokens_per_cost_is_chosen():
    import jax.numpy as jnp

    from jspec.loop.adaptive import choose_width

    costs = StepCosts.create(2.2, forward=[1.0, 1.1, 2.0])  # widths 2, 3 and the full 4; the drafter costs 0.2
    conf = jnp.array([[0.9, 0.9, 0.1]])
    # expected tokens 1.9, 2.71, 2.791 for costs 1.2, 1.3, 2.2: width 3 (index 1)
    assert int(choose_width(conf, jnp.array([True]), costs, (2, 3))) == 1
    assert int(choose_width(conf.at[0, 2].set(1.0), jnp.array([True]), costs, (2, 3))) == 1  # 3.52/2.2 < 2.71/1.3
    assert int(choose_width(jnp.ones((1, 3)), jnp.array([True]), StepCosts.create(2.2, forward=[1.0, 1.1, 1.2]),
                            (2, 3))) == 2  # fmt: skip
    # a finished row does not count: the live one is sure of nothing
    both = jnp.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert int(choose_width(both, jnp.array([False, True]), costs, (2, 3))) == 0


def test_an_adaptive_draft_length_keeps_greedy_output_and_follows_the_drafter_s_confidence():
    """A drafter unsure of everything verifies one draft per step; the target drafting for itself
    (sure, and right) verifies wider; both give plain greedy tokens."""
    target = peaked_model(seed=5)
    prompts = [[7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
    plain = Decoder(target).generate(prompts, 20).tokens
    policy = Adaptive(widths=(2, 3), probe_every=64, max_probe_every=64)
    costs = StepCosts.create(1.22, forward=[1.0, 1.01, 1.02])  # width nearly free: only certainty of nothing stops
    unsure = DraftModel.from_model(tiny_model("qwen2", seed=1, num_layers=1), target, num_draft=4)
    got = SpeculativeDecoder(target, unsure, adaptive=policy, costs=costs).generate(prompts, 20)
    assert got.tokens == plain and got.stats()["drafts_per_verify"] == 1.0
    sure = DraftModel.from_model(target, target, num_draft=4)
    got = SpeculativeDecoder(target, sure, adaptive=policy, costs=costs).generate(prompts, 20)
    assert got.tokens == plain and got.stats()["drafts_per_verify"] > 2.0


def test_sampled_output_with_an_adaptive_draft_length_has_the_target_distribution_with_negative_control():
    """Widths 2 and 3 of a chain of 3, chosen per step: tokens 2-4 distributed as plain sampling's."""
    from stats_util import LEVEL

    def check(result):
        assert result.verify_steps > 0 and result.stats()["drafts_per_verify"] < 3.0

    policy, costs = Adaptive(widths=(2, 3), prior=3.0), StepCosts.create(1.6, forward=[1.0, 1.3, 1.5])
    good, broken = _sampled_p_values(3, policy, costs, check)
    assert good > LEVEL and broken < LEVEL


def test_adaptive_draft_length_options_are_checked(target):
    from jspec.core.sampling import SamplingParams
    from jspec.core.tree import StaticTree

    costs = StepCosts.create(2.0, forward=[1.2, 1.8])
    draft = DraftModel.from_model(tiny_model("qwen2", seed=1, num_layers=1), target, num_draft=3)
    with pytest.raises(ValueError, match="widths must be increasing whole numbers >= 2"):
        Adaptive(widths=(1,))
    with pytest.raises(ValueError, match="widths must be increasing"):
        Adaptive(widths=(3, 2))
    with pytest.raises(ValueError, match=r"below the full width N \+ 1 = 4"):
        SpeculativeDecoder(target, draft, adaptive=Adaptive(widths=(4,)), costs=costs)
    with pytest.raises(ValueError, match=r"needs StepCosts\.forward"):
        SpeculativeDecoder(target, draft, adaptive=Adaptive(widths=(2,)), costs=StepCosts.create(2.0))
    with pytest.raises(ValueError, match="for chain drafters"):
        tree = DraftModel.from_model(
            tiny_model("qwen2", seed=1, num_layers=1), target, tree=StaticTree.from_branching([2, 1])
        )
        SpeculativeDecoder(target, tree, adaptive=Adaptive(widths=(2,)), costs=costs)
    with pytest.raises(ValueError, match="within the speculative step"):
        StepCosts.create(1.0, forward=[1.2, 1.8])
    lookup = SpeculativeDecoder(target, PromptLookup(num_draft=3), adaptive=Adaptive(widths=(2,)), costs=costs)
    with pytest.raises(ValueError, match="PromptLookup gives no confidence"):
        lookup.generate([[5, 6, 7, 5, 6]], 4, SamplingParams.greedy())
