"""The drafter protocol: lookahead tokens scored beside the drafts, drafters as pytrees, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import jspec.loop.engine
from jspec.drafters import ChainProposal, Drafter, Lookahead, PromptLookup
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.models.tiny import tiny_model

V = 97
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=0)


@struct.dataclass
class _ProbeState:
    prev_length: jax.Array  # int32[B], the context's length before the step
    checks: jax.Array  # int32[], live rows checked
    mismatches: jax.Array  # int32[], rows whose lookahead prediction missed


@struct.dataclass
class LookaheadProbe:
    """Drafts two zeros (deterministic) and feeds two lookahead tokens beside them: a copy of the
    pending token at its own position seeing only itself, then token 5 after it. The copy's logits
    are the target's prediction of the step's first emitted token, which greedy decoding emits: at
    commit the probe counts the rows where the argmax of the returned logits is not that token."""

    num_draft = 2
    num_nodes = None
    num_lookahead = 2
    hidden_layers = ()

    def init(self, prompts, ctx, capacity, sampling, hidden):
        return _ProbeState(ctx.length, jnp.int32(0), jnp.int32(0))

    def propose(self, state, ctx, key, sampling):
        b, w = ctx.history.shape[0], self.num_draft + 1
        tokens = jnp.stack([ctx.last, jnp.full_like(ctx.last, 5)], axis=1)
        offsets = jnp.broadcast_to(jnp.array([0, 1]), (b, 2))
        mask = jnp.zeros((b, 2, w + 2), bool).at[:, 0, w].set(True).at[:, 1, w:].set(True)
        drafts = jnp.zeros((b, self.num_draft), jnp.int32)
        return ChainProposal(drafts, None, jnp.ones((b,), bool), Lookahead(tokens, offsets, mask)), state

    def commit(self, state, ctx, feedback):
        live = ctx.length > state.prev_length
        first = jnp.take_along_axis(ctx.history, state.prev_length[:, None], axis=1)[:, 0]
        predicted = jnp.argmax(feedback.lookahead_logits[:, 0], axis=-1)
        return _ProbeState(
            ctx.length,
            state.checks + jnp.sum(live),
            state.mismatches + jnp.sum(live & (first != predicted)),
        )


def _probe_run(target):
    final, _, _ = SpeculativeDecoder(target, LookaheadProbe()).run(PROMPTS, 20)
    counts = int(final.drafter.checks), int(final.drafter.mismatches)
    return [np.asarray(final.out)[i, : int(final.num_generated[i])].tolist() for i in range(len(PROMPTS))], counts


def test_lookahead_tokens_are_scored_but_never_verified_or_seen(target, monkeypatch):
    plain = Decoder(target).generate(PROMPTS, 20).tokens
    tokens, (checks, mismatches) = _probe_run(target)
    assert tokens == plain  # the drafts' verification never saw the lookahead tokens
    assert checks >= 20 and mismatches == 0  # their logits are the target's at their own positions

    # Negative controls (each traced afresh): the logits of the wrong tokens handed back ...
    monkeypatch.setattr(jspec.loop.engine, "_split_logits", lambda logits, w: (logits[:, :w], logits[:, w - 2 :]))
    jax.clear_caches()
    try:
        assert _probe_run(target)[1][1] > 0
        monkeypatch.undo()
        # ... and a verified block that sees the lookahead tokens.
        from jspec.drafters.base import Lookahead

        original = Lookahead.append_to

        def leaky(self, tokens, offsets, local):
            tokens, offsets, mask = original(self, tokens, offsets, local)
            return tokens, offsets, mask.at[:, :3, 3:].set(True)

        monkeypatch.setattr(Lookahead, "append_to", leaky)
        jax.clear_caches()
        assert _probe_run(target)[0] != plain
    finally:
        jax.clear_caches()


def test_drafters_follow_the_protocol_and_carry_their_weights(target):
    from jspec.drafters import DraftModel

    lookup = PromptLookup(num_draft=3)
    draft = DraftModel.from_model(tiny_model("qwen2", seed=1, num_layers=1), target, num_draft=3)
    for drafter in (lookup, draft, LookaheadProbe()):
        assert isinstance(drafter, Drafter)
    assert jax.tree.leaves(lookup) == []  # all static
    assert len(jax.tree.leaves(draft)) > 0  # its weights travel as the loop's arguments


def test_the_engine_refuses_what_is_no_drafter(target):
    from jspec.drafters import DraftModel

    draft = DraftModel.from_model(tiny_model("qwen2", seed=1, num_layers=1), target, num_draft=3)
    with pytest.raises(ValueError, match="Drafter protocol"):
        SpeculativeDecoder(target, (draft, ()))  # the old (drafter, weights) pair
    with pytest.raises(TypeError):  # eos ids are keyword-only: never taken for a drafter's weights
        SpeculativeDecoder(target, draft, (3,))
    with pytest.raises(TypeError):  # drafter knobs are keywords too
        PromptLookup(3, V)
