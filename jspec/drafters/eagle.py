"""EAGLE drafting: a head (:mod:`jspec.heads.eagle`) drafts from the target's own hidden states.

A chain (EAGLE-1 and EAGLE-3): N drafts, the head unrolled with ``lax.scan``. A
tree: a static shape, or EAGLE-2's dynamic tree, whose best ``top_k`` nodes per
depth the head expands, each attending to its cache and its own ancestors; the
children are the head's most likely tokens (deterministic), so their rows are
one-hot and the tree is verified without V-sized work per node. No target
forward while drafting: the engine hands over the target's features at commit.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jspec.core.cache import KVCache
from jspec.core.sampling import SamplingParams
from jspec.core.tree import DynamicTreeSpec, StaticTree, frontier_sizes
from jspec.drafters.base import ChainProposal, Context, Feedback, TreeProposal, draft_depth, if_proposed
from jspec.drafters.unroll import draft_chain, draft_tree
from jspec.heads.eagle import DraftHead
from jspec.heads.formats import load_eagle
from jspec.loop.control import when

__all__ = ["EagleDrafter"]


BACKLOG = 16  # fallback steps whose features a head keeps before running them through itself at once


@struct.dataclass
class _EagleState:
    cache: KVCache  # the head's one-layer cache: one pair per committed target token
    logits: jax.Array  # float32[B, K]: the draft distribution's logits for the token after the pending one
    hidden: jax.Array  # [B, H]: the head's output at the last committed pair
    backlog: tuple  # per feature layer [B, BACKLOG, H]: target features of fallback steps not yet fed
    backlog_len: jax.Array  # int32[B]: how many; they start at the head cache's length


@struct.dataclass(kw_only=True)
class EagleDrafter:
    """A drafter over an EAGLE head. Build it with :meth:`from_head`.

    Attributes:
      weights: the head's NNX state, the target's frozen copies included (the drafter's arrays).
      graphdef: the head's NNX graph (static).
      num_draft: N (a tree's depth).
      vocab_size: the target's vocabulary V (drafts are mapped from the draft vocabulary to it).
      hidden_layers: the target layers the head reads (its feature layers).
      tree: None (a chain), a :class:`jspec.core.tree.StaticTree` or a :class:`jspec.core.tree.DynamicTreeSpec`.
    """

    weights: nnx.State
    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    num_draft: int = struct.field(pytree_node=False)
    vocab_size: int = struct.field(pytree_node=False)
    hidden_layers: tuple[int, ...] = struct.field(pytree_node=False)
    tree: DynamicTreeSpec | StaticTree | None = struct.field(pytree_node=False, default=None)
    num_lookahead = 0

    @property
    def num_nodes(self) -> int | None:
        return None if self.tree is None else self.tree.size

    @classmethod
    def from_head(cls, head: DraftHead | str | os.PathLike, target, *, num_draft: int | None = None,
                  tree: DynamicTreeSpec | StaticTree | None = None) -> EagleDrafter:  # fmt: skip
        """The drafter for ``target``: a chain of ``num_draft`` (default 4), or a tree (N is its depth).

        Args:
          head: a :class:`jspec.heads.eagle.DraftHead`, or the folder or Hub id of a head saved by jspec or
            published in another format (:mod:`jspec.heads.formats`), loaded and attached to ``target``.
          target: the target model.

        Raises:
          ValueError: the head was built for another vocabulary, the folder holds no head, or
            the tree or N is not one a head drafts.
        """
        if not isinstance(head, DraftHead):
            if not isinstance(head, str | os.PathLike):
                raise ValueError(f"head must be a DraftHead, a head's folder or a Hub id; got {type(head).__name__}.")
            head = load_eagle(head, target)
        target_vocab = target.config.vocab_size
        if head.config.vocab_size != target_vocab:
            raise ValueError(
                f"the head was built for a vocabulary of {head.config.vocab_size}, the target has "
                f"{target_vocab}; train or load a head for this target."
            )
        if tree is not None:
            if not isinstance(tree, DynamicTreeSpec | StaticTree):
                raise ValueError(f"tree must be a StaticTree or a DynamicTreeSpec; got {type(tree).__name__}.")
            frontier_sizes(tree)  # refuses a static tree not made by from_branching
        num_draft = draft_depth(num_draft, tree)
        graphdef, weights = nnx.split(head)
        return cls(weights=weights, graphdef=graphdef, num_draft=num_draft, vocab_size=target_vocab,
                   hidden_layers=head.config.feature_layers, tree=tree)  # fmt: skip

    def _pairs(self, head, state_cache, ctx: Context, start, hidden, num_new):
        """Feeds the pairs (feature of token start + j, token start + 1 + j) and reads the output at num_new - 1."""
        t = hidden[0].shape[1]
        cols = start[:, None] + 1 + jnp.arange(t)[None, :]
        tokens = jnp.take_along_axis(ctx.history, jnp.clip(cols, 0, ctx.history.shape[1] - 1), axis=1)
        h, cache = head(tokens, head.fuse(hidden), cols, state_cache.rollback(start), num_new=num_new)
        last = jnp.take_along_axis(h, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
        b = tokens.shape[0]
        backlog = tuple(jnp.zeros((b, BACKLOG, x.shape[-1]), x.dtype) for x in hidden)
        return _EagleState(cache, head.logits(last), last, backlog, jnp.zeros((b,), jnp.int32))

    def _flush(self, head, state: _EagleState, ctx: Context) -> _EagleState:
        """Runs the backlog of fallback steps' pairs through the head in one forward (rows without
        a backlog keep their state)."""
        n = state.backlog_len
        fed = self._pairs(head, state.cache, ctx, state.cache.lengths, state.backlog, n)
        keep = n > 0
        return _EagleState(
            fed.cache.rollback(jnp.where(keep, fed.cache.lengths, state.cache.lengths)),
            jnp.where(keep[:, None], fed.logits, state.logits),
            jnp.where(keep[:, None], fed.hidden, state.hidden),
            fed.backlog,
            fed.backlog_len,
        )

    def _flushed(self, head, state: _EagleState, ctx: Context) -> _EagleState:
        return when(jnp.any(state.backlog_len > 0), lambda s: self._flush(head, s, ctx), state)

    def init(self, prompts, ctx: Context, capacity: int, sampling: SamplingParams, hidden: tuple):
        head = nnx.merge(self.graphdef, self.weights)
        b = prompts.shape[0]
        # Prompt pairs: the feature of token t with token t + 1 (the last one is the pending token).
        start = jnp.zeros((b,), jnp.int32)
        extra = 0 if self.tree is None else sum(frontier_sizes(self.tree))
        return self._pairs(head, head.init_cache(b, capacity + extra), ctx, start, hidden, ctx.cache_length)

    def propose(self, state: _EagleState, ctx: Context, key, sampling: SamplingParams):
        head = nnx.merge(self.graphdef, self.weights)
        state = self._flushed(head, state, ctx)
        if self.tree is not None:
            return self._propose_tree(head, state, ctx), state
        d2t = head.d2t[...]

        def feed(carry, tok, i):
            cache, feature = carry
            position = ctx.cache_length + i  # draft i (1-based) sits i tokens after the pending one
            h, cache = head(d2t[tok][:, None], feature[:, None], position[:, None], cache)
            return head.logits(h[:, 0]), (cache, h[:, 0])

        draft, probs, _, conf = draft_chain(feed, (state.cache, state.hidden), state.logits, self.num_draft, key,
                                            sampling)  # fmt: skip
        b, n, _ = probs.shape  # [B, N, K] over the draft vocabulary
        full = jnp.zeros((b, n, self.vocab_size), probs.dtype).at[:, :, d2t].set(probs)
        return ChainProposal(d2t[draft].astype(jnp.int32), full, None, confidence=conf), state

    def _propose_tree(self, head, state: _EagleState, ctx: Context) -> TreeProposal:
        """A dynamic (EAGLE-2) or static tree. Node scores are the head's log-probabilities at
        temperature 1: the children are deterministic, so exactness does not depend on them."""
        d2t = head.d2t[...]

        def feed(carry, tokens, parent_slot, positions, mask):
            cache, h_prev = carry
            feature = jnp.take_along_axis(h_prev, parent_slot[:, :, None], axis=1)
            h, cache = head(d2t[tokens], feature, positions, cache, mask)
            return head.logits(h), (cache, h)

        b = ctx.history.shape[0]
        root = jnp.zeros((b,), jnp.int32)  # stands for the pending token, put back below
        carry = (state.cache, state.hidden[:, None])
        tree, _ = draft_tree(feed, carry, root, state.logits, self.tree, state.cache.lengths, ctx.cache_length,
                             state.cache.capacity)  # fmt: skip
        t = tree.tokens.shape[1]
        tokens = jnp.where(jnp.arange(t)[None, :] == 0, ctx.last[:, None], d2t[tree.tokens]).astype(jnp.int32)
        used = jnp.ones((b, t), bool)  # probs None: every child is deterministic (one-hot)
        return TreeProposal(tokens, tree.parents, tree.depths, used, None, None)

    def commit(self, state: _EagleState, ctx: Context, feedback: Feedback):
        """The target's features of the pending token and the accepted drafts become committed pairs.

        ``feedback.hidden`` covers the forward the engine just ran from the old pending token on
        (N + 1 tokens, or 1 for a plain step); ``num_accepted + 1`` of them are now committed.
        """
        head = nnx.merge(self.graphdef, self.weights)
        n_new = feedback.num_accepted + 1
        start = jnp.maximum(ctx.cache_length - n_new, 0)  # the old pending token's position
        # A fallback step keeps its feature; the head catches up at the next proposal.
        return if_proposed(feedback, lambda s: self._pairs(head, s.cache, ctx, start, feedback.hidden, n_new),
                           lambda s: self._defer(head, s, ctx, feedback.hidden), state)  # fmt: skip

    def _defer(self, head, state: _EagleState, ctx: Context, hidden) -> _EagleState:
        """Keeps the consumed token's features (live rows) in the backlog; a full backlog is run through
        the head at once, so no fallback step pays for the head but one in ``BACKLOG``."""
        live = ctx.cache_length > state.cache.lengths + state.backlog_len
        slot = jax.nn.one_hot(state.backlog_len, BACKLOG, dtype=bool) & live[:, None]  # [B, BACKLOG]
        backlog = tuple(
            jnp.where(slot[:, :, None], h[:, :1], old) for h, old in zip(hidden, state.backlog, strict=True)
        )
        state = dataclasses.replace(state, backlog=backlog, backlog_len=state.backlog_len + live.astype(jnp.int32))
        full = jnp.any(state.backlog_len >= BACKLOG)
        return when(full, lambda s: self._flush(head, s, ctx), state)
