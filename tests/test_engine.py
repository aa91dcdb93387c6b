"""The speculative engine on tiny random models: greedy equals plain decoding, batching, caches, statistics."""

import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

from jspec.decode import Decoder
from jspec.drafters import Context, DraftModel, PromptLookup
from jspec.engine import SpeculativeDecoder


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=0)


def _prompts():
    rng = np.random.default_rng(0)
    base = rng.integers(4, 97, 6).tolist()
    return [base * 3, rng.integers(4, 97, 9).tolist(), base[:4]]


@pytest.mark.parametrize("num_draft", [1, 4])
def test_prompt_lookup_greedy_equals_plain_greedy(target, num_draft):
    prompts = _prompts()
    want = Decoder(target).generate(prompts, 24).tokens
    got = SpeculativeDecoder(target, PromptLookup(num_draft, 97)).generate(prompts, 24)
    assert got.tokens == want
    assert got.verify_steps + got.plain_steps + 1 == got.target_calls


@pytest.mark.parametrize("same_model", [False, True])
def test_draft_model_greedy_equals_plain_greedy(target, same_model):
    prompts = _prompts()
    draft = target if same_model else tiny_model("qwen2", seed=1, num_layers=1)
    drafter, weights = DraftModel.from_model(draft, 3, 97)
    got = SpeculativeDecoder(target, drafter, weights).generate(prompts, 24)
    assert got.tokens == Decoder(target).generate(prompts, 24).tokens
    if same_model:  # drafting with the target itself: every draft is accepted
        assert got.acceptance_by_position() == [1.0, 1.0, 1.0]
        assert got.tau == pytest.approx(4.0, abs=0.5)


def test_rows_with_different_acceptance_match_each_row_alone(target):
    prompts = _prompts()
    engine = SpeculativeDecoder(target, PromptLookup(4, 97))
    batch = engine.generate(prompts, 20)
    for prompt, row in zip(prompts, batch.tokens, strict=True):
        assert engine.generate([prompt], 20).tokens[0] == row


def test_eos_and_budget_per_row(target):
    prompts = _prompts()
    plain = Decoder(target).generate(prompts, 24).tokens
    eos = plain[0][5]
    got = SpeculativeDecoder(target, PromptLookup(4, 97), eos_ids=(eos,)).generate(prompts, 24).tokens
    want = Decoder(target, eos_ids=(eos,)).generate(prompts, 24).tokens
    assert got == want and len(got[0]) <= 6
    short = SpeculativeDecoder(target, PromptLookup(4, 97)).generate(prompts, 3).tokens
    assert [len(t) for t in short] == [3, 3, 3]


def test_prompt_lookup_finds_the_latest_longest_match():
    lookup = PromptLookup(num_draft=3, vocab_size=50, max_ngram=2)
    history = jnp.array([[5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6, 0, 0]])
    ctx = Context(history, jnp.array([11]), jnp.array([10]))
    proposal, _ = lookup.propose((), (), ctx, None, None)
    assert proposal.tokens.tolist() == [[1, 2, 5]]  # after the latest earlier "5 6"
    assert proposal.has_draft.tolist() == [True]
    none = Context(jnp.array([[1, 2, 3, 4, 0]]), jnp.array([4]), jnp.array([3]))
    assert lookup.propose((), (), none, None, None)[0].has_draft.tolist() == [False]


def test_vocabulary_mismatch_is_a_clear_error(target):
    with pytest.raises(ValueError, match=r"vocabulary \(50\) differs from the target's \(97\)"):
        DraftModel.from_model(tiny_model(vocab_size=50), 3, 97)
