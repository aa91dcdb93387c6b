"""The drafter protocol: what the engine asks of every drafter, and what it tells one.

The engine imports only this module: it never knows which drafter it runs.

A drafter is a pytree (a ``flax.struct.dataclass``): its arrays (a draft model's
or a head's weights) are leaves that the engine passes into its jitted loop as
arguments, and its static facts (N, a tree's shape, a model's graph) are fields
marked ``pytree_node=False``, hashed into the compiled program's key. A drafter
with no arrays (prompt lookup) is all static. Its per-request arrays (a KV
cache, the last logits) travel in a ``state`` pytree that the engine threads
through the loop without looking inside.

Each step:

1. ``propose(state, ctx, key, sampling) -> (proposal, state)``: a
   :class:`ChainProposal` of N drafts per row, or a :class:`TreeProposal` of
   ``num_nodes`` nodes. Either may carry :class:`Lookahead` tokens: tokens fed
   to the target in the same forward, beside the drafts, that are *not*
   verified, each seeing what the drafter's mask says (Lookahead decoding's
   Jacobi window).
2. The engine scores the pending token, the drafts and the lookahead tokens in
   one target forward and accepts a prefix (chain) or path (tree) per row.
3. ``commit(state, ctx, feedback) -> state``: ``ctx`` now holds the accepted
   drafts and the new pending token; :class:`Feedback` says how many drafts
   each row kept, and carries the target's hidden states at the drafter's
   ``hidden_layers`` and its logits at the lookahead tokens.

When no live row has a draft (``has_draft`` all False; prompt lookup found
nothing), the step is a plain one-token step and ``commit`` sees
``num_accepted`` 0 and the hidden states of that one token. An adaptive loop
may also take a plain step without calling ``propose`` at all (speculation did
not pay); ``commit`` is then told so (``Feedback.proposed`` False). A drafter
that feeds lookahead tokens is verified every step, so that its window always
gets the target's logits.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core.sampling import SamplingParams
from jspec.core.tree import ancestor_mask, verify_tree_batch
from jspec.loop.control import cond

__all__ = [
    "DEFAULT_NUM_DRAFT", "ChainProposal", "Context", "Drafter", "Feedback", "Lookahead", "TreeProposal",
    "check_drafter", "check_step_width", "draft_depth", "if_proposed",
]  # fmt: skip

DEFAULT_NUM_DRAFT = 4  # N for a chain when none is given


@struct.dataclass
class Context:
    """What the engine tells a drafter each step.

    Attributes:
      history: int32[B, C], prompt then generated tokens; slots >= length unused.
      length: int32[B], valid tokens in ``history``; the last one is the pending
        token (sampled, not yet fed to any model).
      cache_length: int32[B], tokens the target has in its KV cache
        (``length - 1``).
    """

    history: jax.Array
    length: jax.Array
    cache_length: jax.Array

    @property
    def last(self) -> jax.Array:
        """int32[B]: the pending token."""
        return jnp.take_along_axis(self.history, (self.length - 1)[:, None], axis=1)[:, 0]


@struct.dataclass
class Lookahead:
    """Tokens fed to the target beside the drafts and never verified.

    The step's new tokens are the verified block (W = N + 1 for a chain: the pending
    token and the drafts; W = T for a tree) followed by these E tokens.

    Attributes:
      tokens: int32[B, E].
      offsets: int32[B, E], each token's text position relative to the pending token's
        (the pending token is at offset 0, draft i of a chain at offset i).
      mask: bool[B, E, W + E], which of the step's new tokens each lookahead token sees
        (the committed cache is always seen). The verified block never sees these tokens.
    """

    tokens: jax.Array
    offsets: jax.Array
    mask: jax.Array

    def append_to(self, tokens, offsets, local_mask):
        """The step's new tokens [B, W] with these appended: (tokens, offsets, the local mask
        [B, W + E, W + E] in which the verified block never sees them)."""
        b, w = tokens.shape
        top = jnp.concatenate([local_mask, jnp.zeros((b, w, self.tokens.shape[1]), bool)], axis=2)
        return (
            jnp.concatenate([tokens, self.tokens], axis=1),
            jnp.concatenate([offsets, self.offsets], axis=1),
            jnp.concatenate([top, self.mask], axis=1),
        )


@struct.dataclass
class ChainProposal:
    """N drafts per row, each after the one before.

    Attributes:
      tokens: int32[B, N], the drafts.
      probs: float32[B, N, V], the distributions they were drawn from, or None when
        every draft was chosen deterministically (a lookup, a greedy pick: one-hot
        distributions, verified without V-sized work per draft).
      has_draft: bool[B], whether the row has anything worth verifying; when no
        live row has, the engine takes a plain one-token step instead. None: every row always
        has (a model's drafts): the loop then has no plain step to compile, unless adaptive.
      lookahead: tokens to score but not verify, or None.
      num_drafts: int32[B], how many of the N slots of each row hold drafts (rows draft
        different lengths: a lookup's continuation can be short, a row can have none), or
        None when every row drafts all N. Slots past a row's count are never accepted.
      confidence: float32[B, N], the drafter's estimate that each draft is accepted given the
        ones before it (a model drafter's own probability of the token), or None. An adaptive
        loop with verify widths to choose from (:class:`jspec.loop.adaptive.Adaptive`) weighs it.
    """

    tokens: jax.Array
    probs: jax.Array | None
    has_draft: jax.Array | None
    lookahead: Lookahead | None = None
    num_drafts: jax.Array | None = None
    confidence: jax.Array | None = None

    # What the engine asks of a proposal, so that it never asks which kind it holds.

    def block(self, pending, n: int):
        """The verified block: (tokens [B, N + 1], the pending token then the drafts; their offsets
        from the pending token [B, N + 1]; their mask among themselves [B, N + 1, N + 1], or None for
        plain causal attention, which needs no mask unless lookahead tokens follow)."""
        b = pending.shape[0]
        tokens = jnp.concatenate([pending[:, None], self.tokens], axis=1)
        offsets = jnp.broadcast_to(jnp.arange(n + 1), (b, n + 1))
        local = None if self.lookahead is None else jnp.broadcast_to(jnp.tri(n + 1, dtype=bool), (b, n + 1, n + 1))
        return tokens, offsets, local

    def draft_counts(self):
        """int32[B], drafts per row, or None when every row drafts all N."""
        return self.num_drafts

    def verify(self, q, keys, n: int, counts, verify_chain):
        """The verdict: each row's accepted prefix by ``verify_chain`` (the batched chain verifier),
        ``counts`` [B] drafts per row or None for all N."""
        return verify_chain(self.tokens, self.probs, q, keys, **({} if counts is None else {"num_drafts": counts}))

    def commit(self, cache, cache_length, verdict, kept, hidden):
        """(the target's cache with each row's first ``kept`` block entries kept, ``hidden`` as it is)."""
        return cache.rollback(cache_length + kept), hidden

    def drafts_verified(self, live, n: int, counts):
        """int32[], the live rows' drafts this step verified."""
        return jnp.sum(jnp.where(live, n if counts is None else counts, 0))


@struct.dataclass
class TreeProposal:
    """A draft tree per row (see :mod:`jspec.core.tree`); node 0 is the pending token.

    Attributes:
      tokens: int32[B, T].
      parents: int32[B, T], parents before children, the root's parent 0.
      depths: int32[B, T].
      used: bool[B, T], nodes to verify (the root's flag is ignored).
      probs: float32[B, T, V], per node the distribution it was drawn from
        (the root's row is ignored), or None when every child was chosen
        deterministically (one-hot rows, verified without V-sized work per node).
      has_draft: bool[B], or None for every row (as :class:`ChainProposal`).
      lookahead: tokens to score but not verify, or None.
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    used: jax.Array
    probs: jax.Array | None
    has_draft: jax.Array | None
    lookahead: Lookahead | None = None

    # What the engine asks of a proposal (see :class:`ChainProposal`).

    def block(self, pending, n: int):
        """(the nodes [B, T], their depths [B, T], the ancestor mask [B, T, T]: each node sees its ancestors)."""
        return self.tokens, self.depths, ancestor_mask(self.parents, n)

    def draft_counts(self):
        return None

    def verify(self, q, keys, n: int, counts, verify_chain):
        """The verdict: each row's accepted path by the exact tree rules (``counts`` and the chain
        verifier do not apply)."""
        return verify_tree_batch(self.tokens, self.parents, self.used, self.probs, q, keys, n)

    def commit(self, cache, cache_length, verdict, kept, hidden):
        """The accepted path's entries moved into place in the cache and its hidden states gathered into
        a chain (what the drafter sees)."""
        cache = cache.commit_path(cache_length, verdict.path, kept)
        return cache, tuple(jnp.take_along_axis(h, verdict.path[:, :, None], axis=1) for h in hidden)

    def drafts_verified(self, live, n: int, counts):
        """0: a tree's statistics count nodes, not chain drafts."""
        return jnp.sum(0)


@struct.dataclass
class Feedback:
    """What the target decided, for :meth:`Drafter.commit`.

    Attributes:
      num_accepted: int32[B], drafts each row kept (0 for finished rows and plain steps).
      hidden: tuple of [B, K, H], the target's hidden states at the drafter's
        ``hidden_layers`` over the verified tokens from the old pending token on
        (K = N + 1 for a chain; a tree's accepted path gathered into a chain; K = 1
        for a plain step).
      lookahead_logits: float32[B, E, V], the target's logits at the lookahead tokens,
        or None when the proposal had none.
      proposed: False when the engine took a plain step without asking the drafter for a
        proposal (an adaptive loop's fallback): a drafter with its own cache must take in the
        token the target consumed, which no proposal fed it. A Python bool, or a bool[] array
        where one step serves both cases (the adaptive loop); :func:`if_proposed` reads either.
    """

    num_accepted: jax.Array
    hidden: tuple
    lookahead_logits: jax.Array | None = None
    proposed: bool | jax.Array = True


def if_proposed(feedback: Feedback, proposed_fn, fallback_fn, state):
    """``proposed_fn(state)`` after a step the drafter proposed for, else ``fallback_fn(state)``: chosen
    in Python when ``feedback.proposed`` is a bool, else both traced and the one that holds run."""
    if isinstance(feedback.proposed, bool):
        return proposed_fn(state) if feedback.proposed else fallback_fn(state)
    return cond(feedback.proposed, proposed_fn, fallback_fn, state)


@runtime_checkable
class Drafter(Protocol):
    """The interface of every drafter (see the module docstring).

    Attributes:
      num_draft: N, the most drafts one step can accept (a tree's depth).
      num_nodes: a tree's node budget T, root included; None for a chain.
      num_lookahead: E, lookahead tokens per step (0 for all but Lookahead decoding).
      hidden_layers: the target layers whose hidden states the drafter reads
        (``()`` for most; EAGLE heads name their feature layers).
    """

    num_draft: int
    num_nodes: int | None
    num_lookahead: int
    hidden_layers: tuple[int, ...]

    def init(self, prompts: jax.Array, ctx: Context, capacity: int, sampling: SamplingParams, hidden: tuple):
        """Prefill: returns the drafter's state.

        Args:
          prompts: int32[B, P], right-padded; ``ctx.cache_length`` holds the lengths.
          ctx: the context after the target's first sample (the pending token).
          capacity: the target's cache slots; a drafter with its own cache sizes it so.
          sampling: the request's sampling parameters.
          hidden: the target's hidden states over the prompt [B, P, H] at ``hidden_layers``.
        """
        ...

    def propose(self, state, ctx: Context, key: jax.Array, sampling: SamplingParams):
        """Returns (:class:`ChainProposal` or :class:`TreeProposal`, state)."""
        ...

    def commit(self, state, ctx: Context, feedback: Feedback):
        """Keeps what the target accepted, forgets the rest; returns the state."""
        ...


def draft_depth(num_draft: int | None, tree) -> int | None:
    """N: ``num_draft`` for a chain (default :data:`DEFAULT_NUM_DRAFT`), a tree's own depth for a tree
    (None for a :class:`jspec.core.tree.MeasuredTree`, whose depth is chosen when its drafter is built).

    Raises ValueError for N < 1, and for a ``num_draft`` that differs from the tree's depth
    (it would be ignored).
    """
    if tree is None:
        n = DEFAULT_NUM_DRAFT if num_draft is None else num_draft
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_draft must be a whole number >= 1; got {n!r}.")
        return n
    if tree.max_depth is None:  # a jspec.core.tree.MeasuredTree: its depth is chosen with the drafter
        if num_draft is not None:
            raise ValueError("num_draft conflicts with a measured tree, whose depth is chosen from the measured "
                             "acceptance; leave num_draft out.")  # fmt: skip
        return None
    if num_draft is not None and num_draft != tree.max_depth:
        raise ValueError(
            f"num_draft={num_draft} conflicts with the tree, whose depth ({tree.max_depth}) is the most drafts a "
            "step can accept; leave num_draft out with a tree."
        )
    return tree.max_depth


def check_drafter(drafter) -> None:
    """Raises ValueError, before anything is compiled, when ``drafter`` is no drafter."""
    if not isinstance(drafter, Drafter):
        missing = [n for n in ("num_draft", "num_nodes", "num_lookahead", "hidden_layers", "init", "propose", "commit")
                   if not hasattr(drafter, n)]  # fmt: skip
        raise ValueError(
            f"drafter must follow the jspec.drafters.Drafter protocol (missing {', '.join(missing)}); got "
            f"{type(drafter).__name__}. Build one with jspec.make_drafter(method, target, ...) or a class of "
            "jspec.drafters."
        )
    if int(drafter.num_draft) < 1:
        raise ValueError(f"a drafter's num_draft must be >= 1; got {drafter.num_draft}.")
    if drafter.num_nodes is not None and int(drafter.num_nodes) < 2:
        raise ValueError(f"a tree drafter's num_nodes must be >= 2 (the root and a draft); got {drafter.num_nodes}.")
    if int(drafter.num_lookahead) < 0:
        raise ValueError(f"num_lookahead must be >= 0; got {drafter.num_lookahead}.")


@struct.dataclass
class _Static:
    """Holds a drafter that is no pytree of arrays: static as a whole, so it must be hashable."""

    drafter: object = struct.field(pytree_node=False)


def split_drafter(drafter) -> tuple[jax.tree_util.PyTreeDef, list]:
    """(structure, arrays): a pytree drafter's arrays are arguments of the compiled loop and its
    static fields part of the structure; any other drafter is static as a whole."""
    leaves, treedef = jax.tree.flatten(drafter)
    if all(isinstance(x, jax.Array | np.ndarray) for x in leaves):
        return treedef, leaves
    try:
        hash(drafter)
    except TypeError:
        raise ValueError(
            f"a drafter must be a pytree of arrays (a flax.struct.dataclass) or hashable; {type(drafter).__name__} "
            "is neither."
        ) from None
    return jax.tree.structure(_Static(drafter)), []


def merge_drafter(treedef, leaves):
    """The drafter :func:`split_drafter` took apart."""
    drafter = jax.tree.unflatten(treedef, leaves)
    return drafter.drafter if isinstance(drafter, _Static) else drafter


def check_step_width(drafter, max_position: int | None) -> None:
    """Raises ValueError when one verify step feeds more tokens (the pending token, the drafts or tree
    nodes, the lookahead tokens) than the target's context holds."""
    width = (drafter.num_nodes or drafter.num_draft + 1) + drafter.num_lookahead
    if max_position is not None and width > max_position:
        raise ValueError(f"{type(drafter).__name__} feeds {width} tokens per step, more than the target's context "
                         f"({max_position}); draft fewer (a narrower window, fewer levels or guesses, a smaller N "
                         "or tree).")  # fmt: skip
