"""The draft unroll shared by every model-based drafter (a draft model, an EAGLE head).

A drafter supplies ``feed``: how its model reads tokens against its own cache and
returns logits. This module does the rest the same way for all of them: a chain
is a ``lax.scan`` that samples one draft per step; a tree (static, or EAGLE-2's
dynamic one) is grown depth by depth, each fed node attending to the committed
text and its own ancestors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.sampling import SamplingParams, probs_from_logits, sample
from jspec.tree import (
    DynamicTreeSpec,
    StaticTree,
    frontier_sizes,
    grow_dynamic_tree,
    grow_static_tree,
    tree_attention_mask,
)

__all__ = ["draft_chain", "draft_tree"]


def draft_chain(feed, carry, first_logits, num_draft: int, key, sampling: SamplingParams):
    """N drafts, each sampled from the drafter's distribution after the one before.

    Args:
      feed: ``feed(carry, token int32[B], i) -> (logits float32[B, V'], carry)``: the model
        reads draft i (1-based; it sits i tokens after the pending token) and returns its
        logits for draft i + 1.
      carry: the drafter's arrays threaded through ``feed`` (its cache, a feature).
      first_logits: float32[B, V'], the drafter's logits for draft 1.
      num_draft: N (static).
      key: the step's drafting key; draft i is drawn with ``fold_in(key, i - 1)``.
      sampling: the request's sampling parameters (drafts are drawn as the target samples).

    Returns:
      (tokens int32[B, N] in the drafter's vocabulary, probs float32[B, N, V'], carry).
    """
    probs0 = probs_from_logits(first_logits, sampling)
    tok0 = sample(jax.random.fold_in(key, 0), probs0)

    def step(c, i):
        carry, tok = c
        logits, carry = feed(carry, tok, i)
        p = probs_from_logits(logits, sampling)
        nxt = sample(jax.random.fold_in(key, i), p)
        return (carry, nxt), (nxt, p)

    (carry, _), (toks, probs) = jax.lax.scan(step, (carry, tok0), jnp.arange(1, num_draft))
    tokens = jnp.concatenate([tok0[:, None], jnp.moveaxis(toks, 0, 1)], axis=1).astype(jnp.int32)
    probs = jnp.concatenate([probs0[:, None], jnp.moveaxis(probs, 0, 1)], axis=1)
    return tokens, probs, carry


def draft_tree(feed, carry, root_token, root_logits, tree: StaticTree | DynamicTreeSpec, base, root_position, capacity):
    """A draft tree filled with the drafter's most likely tokens (deterministic children).

    Every node above the last depth is fed once, one depth at a time, to the slots after
    the drafter's committed cache (``base``): the fed nodes of depth d take a block of
    slots after those of depth d - 1, each seeing the committed slots and its own
    ancestors' slots.

    Args:
      feed: ``feed(carry, tokens int32[B, F], parent_slot int32[B, F], positions int32[B, F],
        mask bool[B, F, S]) -> (logits float32[B, F, V'], carry)``; ``parent_slot[b, i]`` is
        node i's parent's index among the previous depth's fed nodes (a head picks the
        parent's hidden state with it).
      carry: the drafter's arrays threaded through ``feed``.
      root_token: int32[B]; root_logits: float32[B, V'], the drafter's logits after the root.
      tree: a :class:`StaticTree` from ``from_branching`` or a :class:`DynamicTreeSpec`.
      base: int32[B], the first slot after the drafter's committed cache.
      root_position: int32[B], the root's text position.
      capacity: S, the drafter's cache slots (static).

    Returns:
      (a :class:`jspec.tree.DynamicTree` of tokens in the drafter's vocabulary, carry).
    """
    sizes = frontier_sizes(tree)
    width = max(sum(sizes), 1)  # slots for the fed nodes, one block per depth
    b = root_logits.shape[0]

    def expand(c, tokens, parent_slot, d):
        inner, ancestors = c
        f, offset = tokens.shape[1], sum(sizes[: d - 1])
        own = jax.nn.one_hot(offset + jnp.arange(f), width, dtype=bool)  # [F, W]
        ancestors = jnp.take_along_axis(ancestors, parent_slot[:, :, None], axis=1) | own[None]
        mask = tree_attention_mask(base, ancestors, capacity)
        positions = jnp.broadcast_to((root_position + d)[:, None], (b, f))
        logits, inner = feed(inner, tokens, parent_slot, positions, mask)
        return jax.nn.log_softmax(logits, axis=-1), (inner, ancestors)

    init = (carry, jnp.zeros((b, 1, width), bool))
    root_logp = jax.nn.log_softmax(root_logits, axis=-1)
    if isinstance(tree, DynamicTreeSpec):
        grown, (carry, _) = grow_dynamic_tree(expand, init, root_token, root_logp, top_k=tree.top_k,
                                              depth=tree.depth, total=tree.total)  # fmt: skip
    else:
        grown, (carry, _) = grow_static_tree(expand, init, root_token, root_logp, tree.branching)
    return grown, carry
