"""A separate, smaller model with the target's tokenizer as the drafter (vanilla speculative decoding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jspec.core.sampling import SamplingParams
from jspec.core.tree import StaticTree
from jspec.drafters.base import ChainProposal, Context, Feedback, TreeProposal, draft_depth, if_proposed
from jspec.drafters.unroll import draft_chain, draft_tree
from jspec.loop.control import cond, when
from jspec.loop.decode import prefill

__all__ = ["DraftModel"]


@struct.dataclass
class _DraftModelState:
    cache: object  # the draft model's KVCache
    pending: jax.Array  # int32[B]: a token accepted last step that the draft model has not seen, or -1
    tree_tokens: jax.Array | None = None  # int32[B, T]: a tree drafter's last tree, read back at commit


@struct.dataclass(kw_only=True)
class DraftModel:
    """A draft model unrolled N steps with ``lax.scan`` (or filling a static tree).

    Its drafts are sampled with the same sampling parameters as the target's, and
    their distributions go to the verifier. Build it with :meth:`from_model`.

    Attributes:
      weights: the model's NNX state (the drafter's arrays).
      graphdef: the model's NNX graph (static).
      num_draft: N (a tree's depth).
      tree: a :class:`jspec.core.tree.StaticTree` from ``from_branching``, or None for a chain.
    """

    weights: nnx.State
    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    num_draft: int = struct.field(pytree_node=False)
    tree: StaticTree | None = struct.field(pytree_node=False, default=None)
    hidden_layers = ()
    num_lookahead = 0

    @classmethod
    def from_model(cls, model: nnx.Module, target, *, num_draft: int | None = None, tree: StaticTree | None = None):
        """The drafter for ``target`` (a model or its vocabulary size); refuses another vocabulary.

        ``num_draft``: N for a chain (default 4). With ``tree`` (a :class:`jspec.core.tree.StaticTree`
        made by ``from_branching``, e.g. [2, 2, 2]) every node's children are the model's most
        likely tokens after it, and N is the tree's depth.
        """
        vocab = model.config.vocab_size
        target_vocab = target if isinstance(target, int) else target.config.vocab_size
        if vocab != target_vocab:
            raise ValueError(
                f"the draft model's vocabulary ({vocab}) differs from the target's ({target_vocab}); "
                "a draft model must share the target's tokenizer."
            )
        if tree is not None and (not isinstance(tree, StaticTree) or tree.branching is None):
            raise ValueError(
                f"a draft model drafts static trees made by StaticTree.from_branching (e.g. [2, 2, 2]) or chains; "
                f"got {tree!r}."
            )
        num_draft = draft_depth(num_draft, tree)
        graphdef, weights = nnx.split(model)
        return cls(weights=weights, graphdef=graphdef, num_draft=num_draft, tree=tree)

    @property
    def num_nodes(self) -> int | None:
        return None if self.tree is None else self.tree.size

    def init(self, prompts, ctx: Context, capacity: int, sampling: SamplingParams, hidden: tuple):
        model = nnx.merge(self.graphdef, self.weights)
        # The same prompt the target prefilled; the target's first sample is the pending token.
        out = prefill(model, prompts, ctx.cache_length, capacity)
        b = prompts.shape[0]
        tree_tokens = None if self.tree is None else jnp.zeros((b, self.tree.size), jnp.int32)
        return _DraftModelState(out.cache, jnp.full((b,), -1, jnp.int32), tree_tokens)

    def propose(self, state: _DraftModelState, ctx: Context, key, sampling: SamplingParams):
        model = nnx.merge(self.graphdef, self.weights)
        last = ctx.last
        # Catch up: feed [pending, last] where a row has a token the model has not seen
        # (all drafts were accepted last step), else only last; a two-token forward
        # costs more than a one-token one, so it runs only when some row needs it.
        has_pending = state.pending >= 0

        def catch_up(carry):
            cache = carry[1]
            first = jnp.stack([jnp.where(has_pending, state.pending, last), last], axis=1)
            positions = cache.lengths[:, None] + jnp.arange(2)[None, :]
            n_new = 1 + has_pending.astype(jnp.int32)
            out = model(first, positions, cache, num_new=n_new, logit_index=n_new - 1)
            return out.logits[:, 0], out.cache

        def one_token(carry):
            out = model(last[:, None], carry[1].lengths[:, None], carry[1])
            return out.logits[:, 0], out.cache

        logits = jax.eval_shape(one_token, (None, state.cache))[0]  # the carry's logits slot, always written
        empty = jnp.zeros(logits.shape, logits.dtype)
        logits0, cache = cond(jnp.any(has_pending), catch_up, one_token, (empty, state.cache))
        if self.tree is not None:
            return self._propose_tree(model, cache, ctx, logits0, state.pending)

        def feed(cache, tok, i):
            out = model(tok[:, None], cache.lengths[:, None], cache)
            return out.logits[:, 0], out.cache

        tokens, probs, cache, conf = draft_chain(feed, cache, logits0, self.num_draft, key, sampling)
        proposal = ChainProposal(tokens, probs, None, confidence=conf)
        return proposal, _DraftModelState(cache, state.pending, state.tree_tokens)

    def _propose_tree(self, model, cache, ctx: Context, logits0, pending):
        """The static tree filled with the model's top choices (deterministic children: ``probs`` None).

        The pending token sits in the cache just before ``cache.lengths``; the fed nodes go
        to the slots after it (:func:`jspec.drafters.unroll.draft_tree`).
        """

        def feed(cache, tokens, parent_slot, positions, mask):
            out = model(tokens, positions, cache, mask)
            return out.logits, out.cache

        tree, cache = draft_tree(feed, cache, ctx.last, logits0, self.tree, cache.lengths, ctx.cache_length,
                                 cache.capacity)  # fmt: skip
        used = jnp.ones_like(tree.tokens, bool)
        proposal = TreeProposal(tree.tokens, tree.parents, tree.depths, used, None, None)
        return proposal, _DraftModelState(cache, pending, tree.tokens)

    def _accepted_path(self, tree_tokens, accepted, num_accepted):
        """int32[B, D + 1]: the nodes from the root whose tokens are the accepted drafts (siblings differ)."""
        parents = jnp.asarray(self.tree.arrays()[0])
        node = jnp.zeros_like(num_accepted)
        path = [node]
        for j in range(self.num_draft):
            match = (parents[None, :] == node[:, None]) & (tree_tokens == accepted[:, j : j + 1])
            match &= jnp.arange(parents.shape[0])[None, :] > 0
            node = jnp.where(j < num_accepted, jnp.argmax(match, axis=1), 0)
            path.append(node)
        return jnp.stack(path, axis=1)

    def _commit_tree(self, state: _DraftModelState, ctx: Context, num_accepted):
        """Finds the accepted path by its tokens and moves its cache entries into place."""
        depth = self.num_draft
        start = ctx.cache_length - num_accepted - 1  # the old pending token's slot
        accepted = jnp.take_along_axis(ctx.history, (start + 1)[:, None] + jnp.arange(depth)[None, :], axis=1)
        path = self._accepted_path(state.tree_tokens, accepted, num_accepted)
        all_in = num_accepted >= depth  # the leaf was never fed: it becomes the pending token
        kept = 1 + num_accepted - all_in.astype(jnp.int32)
        cache = state.cache.commit_path(start, path, kept)
        pending = jnp.where(all_in, accepted[:, depth - 1], -1)
        return _DraftModelState(cache, pending, state.tree_tokens)

    def _catch_up_plain_step(self, state: _DraftModelState, ctx: Context) -> _DraftModelState:
        """After a plain step that no proposal preceded: the target consumed the old pending token,
        which the draft model has not seen. It becomes the draft model's pending token; a row that
        already had one feeds it first (one one-token forward, only when some row needs it), so a
        row is never more than one token behind."""
        model = nnx.merge(self.graphdef, self.weights)
        has_pending = state.pending >= 0

        def feed_pending(cache):
            out = model(jnp.maximum(state.pending, 0)[:, None], cache.lengths[:, None], cache,
                        num_new=has_pending.astype(jnp.int32))  # fmt: skip
            return out.cache

        cache = when(jnp.any(has_pending), feed_pending, state.cache)
        consumed = jnp.take_along_axis(ctx.history, jnp.maximum(ctx.cache_length - 1, 0)[:, None], axis=1)[:, 0]
        behind = ctx.cache_length > cache.lengths  # a live row: the consumed token is now pending
        return _DraftModelState(cache, jnp.where(behind, consumed, -1), state.tree_tokens)

    def commit(self, state: _DraftModelState, ctx: Context, feedback: Feedback):
        """``ctx`` is the context after the step: the accepted drafts and the new pending token appended.

        The draft cache holds the old pending token and drafts 1..N-1, so it
        agrees with the committed text up to ``ctx.cache_length`` unless all N
        drafts were accepted: the last draft was never fed, and becomes the
        next step's catch-up token.
        """
        return if_proposed(feedback, lambda s: self._commit(s, ctx, feedback.num_accepted),
                           lambda s: self._catch_up_plain_step(s, ctx), state)  # fmt: skip

    def _commit(self, state: _DraftModelState, ctx: Context, num_accepted) -> _DraftModelState:
        if self.tree is not None:
            return self._commit_tree(state, ctx, num_accepted)
        all_in = num_accepted >= self.num_draft
        lengths = ctx.cache_length - all_in.astype(jnp.int32)
        last_draft = jnp.take_along_axis(ctx.history, jnp.maximum(ctx.length - 2, 0)[:, None], axis=1)[:, 0]
        pending = jnp.where(all_in, last_draft, -1)
        return _DraftModelState(state.cache.rollback(lengths), pending, state.tree_tokens)
