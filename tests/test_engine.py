"""The speculative engine on tiny random models: greedy equals plain decoding, batching, caches, statistics."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.core.sampling import SamplingParams
from jspec.drafters import ChainProposal, Context, DraftModel, Feedback, PromptLookup
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.models.tiny import peaked_model, tiny_model


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
    got = SpeculativeDecoder(target, PromptLookup(num_draft=num_draft)).generate(prompts, 24)
    assert got.tokens == want
    assert got.verify_steps + got.plain_steps + 1 == got.target_calls


@pytest.mark.parametrize("same_model", [False, True])
def test_draft_model_greedy_equals_plain_greedy(target, same_model):
    prompts = _prompts()
    draft = target if same_model else tiny_model("qwen2", seed=1, num_layers=1)
    drafter = DraftModel.from_model(draft, 97, num_draft=3)
    got = SpeculativeDecoder(target, drafter).generate(prompts, 24)
    assert got.tokens == Decoder(target).generate(prompts, 24).tokens
    if same_model:  # drafting with the target itself: every draft is accepted
        assert got.acceptance_by_position() == [1.0, 1.0, 1.0]
        assert got.tau == pytest.approx(4.0, abs=0.5)


def test_a_listened_to_loop_gives_the_same_tokens_and_shows_every_step(target):
    """Streaming resumes the loop one step at a time (two programs of its own: the prefill and a
    resumable loop): the same tokens and statistics as the whole loop in one program, the listener
    sees the prefill's token and then every step, its counts growing to the final ones; a second
    streamed call compiles nothing."""
    prompts = _prompts()
    engine = SpeculativeDecoder(target, PromptLookup(num_draft=4))
    whole = engine.generate(prompts, 24)
    seen = []
    streamed = engine.generate(prompts, 24, on_tokens=lambda tokens, counts: seen.append((tokens, counts)))
    assert streamed.tokens == whole.tokens and streamed.accept_hist == whole.accept_hist
    again = engine.generate(prompts, 24, on_tokens=lambda tokens, counts: None)
    assert again.tokens == whole.tokens and again.compile_seconds < 0.1 * streamed.compile_seconds
    counts = [c[: len(prompts)].tolist() for _, c in seen]
    assert counts[0] == [1, 1, 1] and len(seen) == whole.verify_steps + whole.plain_steps + 1
    assert all(np.all(np.asarray(b) >= np.asarray(a)) for a, b in itertools.pairwise(counts))
    tokens, final = seen[-1]
    assert [tokens[i, : final[i]].tolist() for i in range(len(prompts))] == whole.tokens


def test_rows_with_different_acceptance_match_each_row_alone(target):
    prompts = _prompts()
    engine = SpeculativeDecoder(target, PromptLookup(num_draft=4))
    batch = engine.generate(prompts, 20)
    for prompt, row in zip(prompts, batch.tokens, strict=True):
        assert engine.generate([prompt], 20).tokens[0] == row


def test_eos_and_budget_per_row(target):
    prompts = _prompts()
    plain = Decoder(target).generate(prompts, 24).tokens
    eos = plain[0][5]
    got = SpeculativeDecoder(target, PromptLookup(num_draft=4), eos_ids=(eos,)).generate(prompts, 24).tokens
    want = Decoder(target, eos_ids=(eos,)).generate(prompts, 24).tokens
    assert got == want and len(got[0]) <= 6
    short = SpeculativeDecoder(target, PromptLookup(num_draft=4)).generate(prompts, 3).tokens
    assert [len(t) for t in short] == [3, 3, 3]


def test_prompt_lookup_finds_the_latest_longest_match():
    lookup = PromptLookup(num_draft=3, max_ngram=2)
    history = jnp.array([[5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6, 0, 0]])
    ctx = Context(history, jnp.array([11]), jnp.array([10]))
    proposal, _ = lookup.propose((), ctx, None, None)
    assert proposal.tokens.tolist() == [[1, 2, 5]]  # after the latest earlier "5 6"
    assert proposal.has_draft.tolist() == [True]
    none = Context(jnp.array([[1, 2, 3, 4, 0]]), jnp.array([4]), jnp.array([3]))
    assert lookup.propose((), none, None, None)[0].has_draft.tolist() == [False]


def test_vocabulary_mismatch_is_a_clear_error(target):
    with pytest.raises(ValueError, match=r"vocabulary \(50\) differs from the target's \(97\)"):
        DraftModel.from_model(tiny_model(vocab_size=50), target, num_draft=3)


class _ScriptedDrafter:
    """Proposes fixed drafts per row (a test double with the drafter interface)."""

    def __init__(self, drafts):
        self.num_draft = drafts.shape[1]
        self._drafts = tuple(map(tuple, drafts.tolist()))

    def __hash__(self):
        return hash(self._drafts)

    def __eq__(self, other):
        return isinstance(other, _ScriptedDrafter) and other._drafts == self._drafts

    hidden_layers = ()
    num_nodes = None
    num_lookahead = 0

    def init(self, prompts, ctx, capacity, sampling, hidden):
        return ()

    def propose(self, state, ctx, key, sampling):
        tokens = jnp.asarray(self._drafts, jnp.int32)
        return ChainProposal(tokens, None, jnp.ones(tokens.shape[0], bool)), state

    def commit(self, state, ctx, feedback):
        return state


def test_seed_lesson_exercise_cache_lengths_and_no_recompute(target):
    """Row A's drafts are the target's own greedy tokens (all accepted); row B's second draft is wrong."""
    n = 4
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]]
    greedy = Decoder(target).generate(prompts, n + 2).tokens
    drafts = np.array([greedy[0][1 : n + 1], greedy[1][1 : n + 1]])
    drafts[1, 1] = (drafts[1, 1] + 1) % 97  # B rejects at draft position 2
    engine = SpeculativeDecoder(target, _ScriptedDrafter(drafts))
    result = engine.generate(prompts, 3)  # one verify step serves both rows' budgets
    assert result.target_calls == 2 and result.verify_steps == 1  # prefill + one verify: nothing recomputed
    assert result.accept_hist == [0, 1, 0, 0, 1]  # B accepted 1, A accepted all 4
    # Committed in the target cache: prompt, the pending token, and the accepted drafts.
    assert result.cache_lengths == [5 + 1 + n, 5 + 1 + 1]
    assert result.tokens == [greedy[0][:3], greedy[1][:3]]


def test_sampled_output_has_the_target_distribution_with_negative_control():
    """Temperature 1: the 2nd and 3rd emitted tokens (both verified) match plain sampling."""
    import jax
    from scipy import stats

    from jspec.analysis.check import two_sample_chi2, verify_chain_without_residual
    from jspec.core.sampling import SamplingParams
    from jspec.core.verify import verify_chain

    rows = 3000
    prompts = [[7, 8, 9, 10]] * rows
    params = SamplingParams.create(temperature=1.0)
    target = peaked_model(seed=5)
    plain = np.array(Decoder(target).generate(prompts, 3, params, seed=1).tokens)
    draft = peaked_model(seed=6, num_layers=1)
    drafter = DraftModel.from_model(draft, 97, num_draft=2)

    def p_value(verifier):
        engine = SpeculativeDecoder(target, drafter, verifier=jax.vmap(verifier))
        spec = np.array(engine.generate(prompts, 3, params, seed=2).tokens)
        chi2, dof = 0.0, 0
        for j in (1, 2):
            c, d = two_sample_chi2(np.bincount(spec[:, j], minlength=97), np.bincount(plain[:, j], minlength=97))
            chi2, dof = chi2 + c, dof + d
        return stats.chi2.sf(chi2, dof)

    from stats_util import LEVEL

    assert p_value(verify_chain) > LEVEL
    assert p_value(verify_chain_without_residual) < LEVEL


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_draft_model_drafts_are_its_own_greedy_continuation_after_a_commit(accepted):
    """After any number accepted (the one-token and the catch-up paths), the next drafts are what
    the draft model alone would generate from the committed text: its cache was rolled back right."""
    draft = tiny_model("qwen2", seed=1, num_layers=1)
    drafter = DraftModel.from_model(draft, 97, num_draft=3)
    greedy = SamplingParams.greedy()
    prompt = [11, 12, 13, 14, 15]
    capacity = 32
    history = jnp.zeros((1, capacity), jnp.int32).at[0, :6].set(jnp.array([*prompt, 40]))
    ctx = Context(history, jnp.array([6]), jnp.array([5]))  # 40: the target's first sample, pending
    state = drafter.init(jnp.array([prompt]), ctx, capacity, greedy, ())
    proposal, state = drafter.propose(state, ctx, jax.random.PRNGKey(0), greedy)
    drafts = proposal.tokens[0].tolist()
    assert drafts == Decoder(draft).generate([[*prompt, 40]], 3).tokens[0]
    # The target accepts `accepted` drafts and emits 50 (a correction, or the bonus when all pass).
    text = [*prompt, 40, *drafts[:accepted], 50]
    history = jnp.zeros((1, capacity), jnp.int32).at[0, : len(text)].set(jnp.array(text))
    ctx = Context(history, jnp.array([len(text)]), jnp.array([len(text) - 1]))
    state = drafter.commit(state, ctx, Feedback(jnp.array([accepted]), ()))
    proposal, _ = drafter.propose(state, ctx, jax.random.PRNGKey(1), greedy)
    assert proposal.tokens[0].tolist() == Decoder(draft).generate([text], 3).tokens[0]


def test_engine_cache_is_sized_to_the_request_with_negative_control(target, monkeypatch):
    """Prompts of 20 and 9 tokens, 40 new: buckets 32 + 64, but 64 slots (plus one verify) suffice."""
    import jspec.loop.batching

    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 97, n).tolist() for n in (20, 9)]
    want = Decoder(target).generate(prompts, 40).tokens
    drafter = DraftModel.from_model(target, 97, num_draft=3)  # the target drafting: every step writes 4 slots
    engine = SpeculativeDecoder(target, drafter)
    got = engine.generate(prompts, 40)
    ((_, loop),) = engine._compiled
    config = loop.config
    assert (config.prompt_len, config.max_new, config.cache_len, config.capacity(4)) == (32, 64, 64, 68)
    assert got.tokens == want
    # Negative control: a cache of 40 + 4 slots loses row 0's later keys: its output changes, or (reads past
    # the cache come back NaN) the run is refused as non-finite; either way it is not the plain output.
    monkeypatch.setattr(jspec.loop.batching, "cache_slots", lambda *args: 40)
    try:
        assert SpeculativeDecoder(target, drafter).generate(prompts, 40).tokens[0] != want[0]
    except ValueError as err:
        assert "NaN or infinite logits" in str(err)
