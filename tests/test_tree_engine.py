"""Tree decoding in the engine: one target forward over the tree, the accepted path moved into place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

from jspec.core.cache import KVCache
from jspec.core.tree import DynamicTreeSpec, StaticTree
from jspec.drafters import EagleDrafter, Feedback, TreeProposal
from jspec.heads.eagle import DraftHead, HeadConfig, draft_vocabulary
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.models.tiny import tiny_model

V = 97
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=0, num_layers=4)


@struct.dataclass
class OracleTree:
    """A [2, 2, 2] tree whose second child at every node is the right greedy token, the first a wrong one.

    ``oracle`` (its array, a pytree leaf) is int32[B, C]: each row's prompt and plain greedy
    continuation. Every accepted path runs through second children, so the accepted entries of
    the target's cache must move (slots 2, 4 or 6 and so on to 1, 2, 3).
    """

    oracle: jax.Array
    num_draft = 3
    num_nodes = 15
    num_lookahead = 0
    hidden_layers = ()

    def init(self, prompts, ctx, capacity, sampling, hidden):
        return ()

    def propose(self, state, ctx, key, sampling):
        weights = self.oracle
        tree = StaticTree.from_branching([2, 2, 2])
        parents, depths = (jnp.asarray(x) for x in tree.arrays())
        rank = jnp.asarray([0] + [(i - 1) % 2 for i in range(1, tree.size)])
        b = ctx.history.shape[0]
        cols = jnp.clip(ctx.length[:, None] - 1 + depths[None, :], 0, weights.shape[1] - 1)
        right = jnp.take_along_axis(weights, cols, axis=1)
        tokens = jnp.where(rank[None] == 1, right, (right + 1) % V)
        tokens = tokens.at[:, 0].set(ctx.last).astype(jnp.int32)
        probs = jax.nn.one_hot(tokens, V)
        bcast = lambda x: jnp.broadcast_to(x[None], (b, tree.size))  # noqa: E731
        ones = jnp.ones((b, tree.size), bool)
        return TreeProposal(tokens, bcast(parents), bcast(depths), ones, probs, ones[:, 0]), state

    def commit(self, state, ctx, feedback):
        return state


def _oracle(prompts, plain, width=64):
    out = np.zeros((len(prompts), width), np.int32)
    for i, (p, g) in enumerate(zip(prompts, plain, strict=True)):
        seq = p + g
        out[i, : len(seq)] = seq
    return jnp.asarray(out)


def test_tree_decoding_moves_the_accepted_path_into_place(target):
    plain = Decoder(target).generate(PROMPTS, 20).tokens
    got = SpeculativeDecoder(target, OracleTree(_oracle(PROMPTS, plain))).generate(PROMPTS, 20)
    assert got.tokens == plain
    assert got.accept_hist[-1] == sum(got.accept_hist)  # every step accepted a full path of 3
    for p, g, length in zip(PROMPTS, plain, got.cache_lengths, strict=True):
        # The prompt, then 4 tokens (pending + 3 accepted) per step, the last step perhaps past the budget.
        assert (length - len(p)) % 4 == 0 and len(p) + len(g) - 1 <= length < len(p) + len(g) + 3


def test_tree_decoding_negative_control_without_moving_the_path(target, monkeypatch):
    """If the accepted path's keys and values stayed where the tree put them, later tokens would change."""
    plain = Decoder(target).generate(PROMPTS, 20).tokens

    def keep_in_place(self, start, path, num_new):
        return self.rollback(start + num_new)

    monkeypatch.setattr(KVCache, "commit_path", keep_in_place)
    jax.clear_caches()  # the engine's jitted loop must be traced again with the broken method
    try:
        got = SpeculativeDecoder(target, OracleTree(_oracle(PROMPTS, plain))).generate(PROMPTS, 20)
    finally:
        jax.clear_caches()  # and no later test may reuse that trace
    assert got.tokens != plain


def _head(target, k=40, seed=1):
    config = HeadConfig.for_target(target.config, "eagle3", draft_vocab_size=k)
    head = DraftHead(config, rngs=nnx.Rngs(seed))
    head.attach_target(target, draft_vocabulary(np.arange(V)[::-1], k))
    return head


TREES = [DynamicTreeSpec(top_k=4, depth=3, total=12), DynamicTreeSpec(8, 2, 9), StaticTree.from_branching([8, 2, 1])]


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_eagle_tree_greedy_equals_plain_greedy(target, tree):
    drafter = EagleDrafter.from_head(_head(target), target, tree=tree)
    got = SpeculativeDecoder(target, drafter).generate(PROMPTS, 24)
    assert got.tokens == Decoder(target).generate(PROMPTS, 24).tokens
    depth = tree.max_depth if isinstance(tree, StaticTree) else tree.depth
    assert drafter.num_draft == depth and len(got.accept_hist) == depth + 1
    assert got.verify_steps + 1 == got.target_calls
    assert sum(got.accept_hist[1:]) > 0  # some drafts were accepted, so paths were committed


def test_tree_options_are_checked(target):
    with pytest.raises(ValueError, match="top_k"):
        DynamicTreeSpec(top_k=2, depth=2, total=8)
    with pytest.raises(ValueError, match="from_branching"):
        EagleDrafter.from_head(_head(target), target, tree=StaticTree((0, 0, 1)))


def test_prompt_lookup_tree_holds_continuations_with_different_first_tokens():
    from jspec.drafters import PromptLookup

    lookup = PromptLookup(num_draft=3, num_paths=3)
    history = jnp.asarray([1, 2, 3, 1, 2, 4, 1, 2] + [0] * 8)
    tokens, used = lookup._tree_row(history, jnp.int32(8))
    # "1 2" ended at 4 and at 1: the later match first; no third continuation with a new first token.
    np.testing.assert_array_equal(np.asarray(tokens[:2]), [[4, 1, 2], [3, 1, 2]])
    np.testing.assert_array_equal(np.asarray(used), [[True] * 3, [True] * 3, [False] * 3])
    assert lookup.num_nodes == 10


def test_prompt_lookup_tree_greedy_equals_plain_greedy(target):
    from jspec.drafters import PromptLookup

    prompts = [[5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6], [11, 12, 13, 11, 12, 14, 11, 12]]
    plain = Decoder(target).generate(prompts, 24).tokens
    got = SpeculativeDecoder(target, PromptLookup(num_draft=3, num_paths=3)).generate(prompts, 24)
    assert got.tokens == plain
    assert got.verify_steps > 0


# ------------------------------------------------------------------ a draft model drafting static trees


@pytest.mark.parametrize("same_model", [False, True])
def test_draft_model_tree_greedy_equals_plain_greedy(target, same_model):
    from jspec.drafters import DraftModel

    draft = target if same_model else tiny_model("qwen2", seed=1, num_layers=1)
    drafter = DraftModel.from_model(draft, V, tree=StaticTree.from_branching([2, 2, 2]))
    assert drafter.num_draft == 3 and drafter.num_nodes == 15
    got = SpeculativeDecoder(target, drafter).generate(PROMPTS, 24)
    assert got.tokens == Decoder(target).generate(PROMPTS, 24).tokens
    if same_model:  # the model's top choice is the target's greedy token: every path goes to a leaf
        assert got.acceptance_by_position() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("path", [(2, 6), (2, 6, 14), (1,), ()], ids=str)
def test_draft_model_tree_commit_moves_the_accepted_path_into_place(path, monkeypatch):
    """After a tree step, the draft model's cache holds exactly what a fresh prefill of the
    committed text gives (the accepted nodes' entries moved from their tree slots); a path
    reaching a leaf leaves the leaf pending. Negative control: keeping the first slots instead."""
    from jspec.core.sampling import SamplingParams
    from jspec.drafters import Context, DraftModel

    draft = tiny_model("qwen2", seed=1, num_layers=2)
    drafter = DraftModel.from_model(draft, V, tree=StaticTree.from_branching([2, 2, 2]))
    greedy, prompt, capacity = SamplingParams.greedy(), [11, 12, 13, 14, 15], 40

    def committed_cache():
        history = jnp.zeros((1, capacity), jnp.int32).at[0, :6].set(jnp.array([*prompt, 40]))
        ctx = Context(history, jnp.array([6]), jnp.array([5]))  # 40: the pending token
        state = drafter.init(jnp.array([prompt]), ctx, capacity, greedy, ())
        proposal, state = drafter.propose(state, ctx, jax.random.PRNGKey(0), greedy)
        tokens = proposal.tokens[0].tolist()
        text = [*prompt, 40, *(tokens[i] for i in path), 50]  # 50: the correction or bonus token
        history = jnp.zeros((1, capacity), jnp.int32).at[0, : len(text)].set(jnp.array(text))
        ctx = Context(history, jnp.array([len(text)]), jnp.array([len(text) - 1]))
        state = drafter.commit(state, ctx, Feedback(jnp.array([len(path)]), ()))
        return state, text

    state, text = committed_cache()
    fed = text[:-1] if len(path) < 3 else text[:-2]  # a leaf is never fed: it stays pending
    assert int(state.cache.lengths[0]) == len(fed)
    assert int(state.pending[0]) == (text[-2] if len(path) == 3 else -1)
    fresh = draft(jnp.array([fed]), jnp.arange(len(fed))[None], draft.init_cache(1, capacity)).cache
    n = len(fed)
    np.testing.assert_allclose(state.cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5)
    np.testing.assert_allclose(state.cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5)

    if path in [(2, 6), (2, 6, 14)]:  # not the first nodes of the tree: a drafter ignoring the path fails

        def contiguous(self, tree_tokens, accepted, num_accepted):
            return jnp.broadcast_to(jnp.arange(self.num_draft + 1), (accepted.shape[0], self.num_draft + 1))

        monkeypatch.setattr(DraftModel, "_accepted_path", contiguous)
        broken, _ = committed_cache()
        assert not np.allclose(broken.cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5)


@pytest.mark.slow  # 29 s; a tool for looking inside a step (jspec.analysis.trace), not part of decoding
def test_first_step_trace_is_the_loops_first_step(target):
    """jspec.analysis.trace.first_step: the tree, the accepted path and the tokens of the loop's first step
    (sampled: the same keys; a chain and a drafter that finds nothing to draft, a plain step)."""
    from jspec.analysis.trace import first_step
    from jspec.core.sampling import SamplingParams
    from jspec.drafters import PromptLookup

    sampling = SamplingParams.create(1.0)
    plain = Decoder(target).generate(PROMPTS[:1], 20).tokens
    oracle = OracleTree(_oracle(PROMPTS[:1], plain))
    for drafter in (oracle, PromptLookup(num_draft=3)):  # a tree whose paths are accepted; a chain
        trace = first_step(target, drafter, PROMPTS[0], sampling, seed=5)
        got = SpeculativeDecoder(target, drafter).generate(PROMPTS[:1], 12, sampling, seed=5).tokens[0]
        assert [trace.first_token, *trace.emitted] == got[: 1 + len(trace.emitted)]
        assert (trace.parents[trace.path[1:]] == trace.path[:-1]).all()  # a path from node 0
    greedy = first_step(target, oracle, PROMPTS[0])
    np.testing.assert_array_equal(greedy.path, [0, 2, 6, 14])  # second children all the way down
    assert greedy.emitted[:3] == plain[0][1:4]
