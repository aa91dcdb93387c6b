"""The draft unroll shared by every model-based drafter (a draft model, an EAGLE head), and tree growth.

A drafter supplies ``feed``: how its model reads tokens against its own cache and
returns logits. This module does the rest the same way for all of them: a chain
is a ``lax.scan`` that samples one draft per step; a tree (static, or EAGLE-2's
dynamic one) is grown depth by depth, each fed node attending to the committed
text and its own ancestors.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from jspec.core.sampling import SamplingParams, probs_from_logits, sample
from jspec.core.tree import DynamicTreeSpec, StaticTree, frontier_sizes, tree_attention_mask

__all__ = ["DynamicTree", "draft_chain", "draft_tree", "grow_dynamic_tree", "grow_static_tree", "select_dynamic_tree"]


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
      (tokens int32[B, N] in the drafter's vocabulary, probs float32[B, N, V'], carry,
      confidence float32[B, N]: the drafter's own probability of each draft at temperature 1,
      its estimate that the target agrees, what an adaptive draft length weighs).
    """
    probs0 = probs_from_logits(first_logits, sampling)
    tok0 = sample(jax.random.fold_in(key, 0), probs0)

    def confidence(logits, tok):
        return jnp.take_along_axis(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), tok[:, None], axis=-1)[:, 0]

    def step(c, i):
        carry, tok = c
        logits, carry = feed(carry, tok, i)
        p = probs_from_logits(logits, sampling)
        nxt = sample(jax.random.fold_in(key, i), p)
        return (carry, nxt), (nxt, p, confidence(logits, nxt))

    (carry, _), (toks, probs, conf) = jax.lax.scan(step, (carry, tok0), jnp.arange(1, num_draft))
    tokens = jnp.concatenate([tok0[:, None], jnp.moveaxis(toks, 0, 1)], axis=1).astype(jnp.int32)
    probs = jnp.concatenate([probs0[:, None], jnp.moveaxis(probs, 0, 1)], axis=1)
    conf = jnp.concatenate([confidence(first_logits, tok0)[:, None], jnp.moveaxis(conf, 0, 1)], axis=1)
    return tokens, probs, carry, conf


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
      (a :class:`DynamicTree` of tokens in the drafter's vocabulary, carry).
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


def select_dynamic_tree(scores, parents, total: int):
    """EAGLE-2's final pick: the ``total`` best candidates by score, renumbered into a tree.

    Scores are cumulative draft log-probabilities, which only fall along a
    path, so a kept node's ancestors score at least as high; ties are broken
    toward earlier candidates, which are ancestors, so every kept node's
    parent is kept.

    Args:
      scores: float32[C]; candidate 0 is the root (its score should be the highest, e.g. 0).
      parents: int32[C]; parent candidate of each (earlier in candidate order).
      total: nodes to keep, root included (static).

    Returns:
      (index int32[total] of the kept candidates in candidate order, parents int32[total]
      as indices into the kept list).
    """
    c = scores.shape[0]
    order = jnp.argsort(-scores, stable=True)[:total]
    keep = jnp.sort(order)  # candidate order keeps parents before children
    new_index = jnp.full((c,), 0, jnp.int32).at[keep].set(jnp.arange(total, dtype=jnp.int32))
    new_parents = new_index[parents[keep]]
    return keep, new_parents.at[0].set(0)


@struct.dataclass
class DynamicTree:
    """EAGLE-2 trees, one per row.

    Attributes:
      tokens: int32[B, T]; node 0 is the root.
      parents: int32[B, T]; parents before children.
      depths: int32[B, T].
      scores: float32[B, T]; cumulative draft log-probability (the root's is 0).
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    scores: jax.Array


def grow_dynamic_tree(expand, state, root_token, root_logp, *, top_k: int, depth: int, total: int):
    """EAGLE-2's dynamic draft tree for each row of a batch, with static shapes.

    Depth 1 holds the ``top_k`` most likely tokens after the root. At each
    further depth the ``top_k`` best nodes of the previous depth (the frontier,
    by cumulative log-probability) are fed to the drafter and each gets its
    ``top_k`` most likely children: ``top_k**2`` candidates, whose best
    ``top_k`` are the next frontier. Every candidate may end in the tree: the
    ``total`` best of them all (root included) are kept (:func:`select_dynamic_tree`).

    Args:
      expand: ``expand(state, tokens int32[B, K], parent_slot int32[B, K], d) -> (logp float32[B, K, V], state)``:
        the drafter reads the frontier at depth d (``parent_slot[b, i]`` is the
        index of node i's parent in the previous frontier, so that the drafter
        can build its own ancestor mask and pick the parent's hidden state) and
        returns each node's log-probabilities for the next token.
      state: the drafter's state, threaded through ``expand``.
      root_token: int32[B]; root_logp: float32[B, V], the drafter's log-probabilities after the root.
      top_k, depth, total: static; ``total <= 1 + top_k + (depth - 1) * top_k**2``.

    Returns:
      (:class:`DynamicTree`, state).
    """
    k = top_k
    most = 1 + k + (depth - 1) * k * k
    if not 1 <= total <= most or k < 1 or depth < 1:
        raise ValueError(
            f"need top_k >= 1, depth >= 1 and 1 <= total <= 1 + top_k + (depth - 1) * top_k**2 = {most}; "
            f"got top_k={k}, depth={depth}, total={total}."
        )
    b = root_logp.shape[0]
    scores, tok = jax.lax.top_k(root_logp.astype(jnp.float32), k)
    tok = tok.astype(jnp.int32)
    cand_tokens = [jnp.asarray(root_token, jnp.int32)[:, None], tok]
    cand_scores = [jnp.full((b, 1), jnp.inf, jnp.float32), scores]  # the root always stays
    cand_parents = [jnp.zeros((b, 1 + k), jnp.int32)]
    cand_depths = [jnp.zeros((b, 1), jnp.int32), jnp.ones((b, k), jnp.int32)]
    frontier_idx = jnp.broadcast_to(1 + jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate indices
    frontier_tok, frontier_score = tok, scores
    parent_slot = jnp.zeros((b, k), jnp.int32)
    offset = 1 + k
    for d in range(1, depth):
        logp, state = expand(state, frontier_tok, parent_slot, d)
        child_logp, child_tok = jax.lax.top_k(logp.astype(jnp.float32), k)  # [B, K, K]
        child_scores = (frontier_score[:, :, None] + child_logp).reshape(b, k * k)
        child_tok = child_tok.reshape(b, k * k).astype(jnp.int32)
        cand_tokens.append(child_tok)
        cand_scores.append(child_scores)
        cand_parents.append(jnp.repeat(frontier_idx, k, axis=1))
        cand_depths.append(jnp.full((b, k * k), d + 1, jnp.int32))
        frontier_score, best = jax.lax.top_k(child_scores, k)
        frontier_tok = jnp.take_along_axis(child_tok, best, axis=1)
        parent_slot = (best // k).astype(jnp.int32)
        frontier_idx = (offset + best).astype(jnp.int32)
        offset += k * k
    tokens, scores = jnp.concatenate(cand_tokens, 1), jnp.concatenate(cand_scores, 1)
    parents, depths = jnp.concatenate(cand_parents, 1), jnp.concatenate(cand_depths, 1)
    keep, new_parents = jax.vmap(select_dynamic_tree, in_axes=(0, 0, None))(scores, parents, total)
    pick = lambda x: jnp.take_along_axis(x, keep, axis=1)  # noqa: E731
    kept_scores = pick(scores).at[:, 0].set(0.0)
    return DynamicTree(pick(tokens), new_parents, pick(depths), kept_scores), state


def grow_static_tree(expand, state, root_token, root_logp, branching: Sequence[int]):
    """A tree of fixed shape (:meth:`StaticTree.from_branching`) filled with the drafter's top choices.

    Every node at depth d gets the ``branching[d]`` most likely tokens after it as
    children; every node above the last depth is fed to the drafter (``expand``,
    as in :func:`grow_dynamic_tree`). Node order is
    ``StaticTree.from_branching(branching)``'s.

    Returns:
      (:class:`DynamicTree` with the static tree's parents and depths, state).
    """
    branching = [int(x) for x in branching]
    shape = StaticTree.from_branching(branching)
    b = root_logp.shape[0]
    scores, tok = jax.lax.top_k(root_logp.astype(jnp.float32), branching[0])
    all_tokens = [jnp.asarray(root_token, jnp.int32)[:, None], tok.astype(jnp.int32)]
    all_scores = [jnp.zeros((b, 1), jnp.float32), scores]
    frontier_tok, frontier_score = tok.astype(jnp.int32), scores
    parent_slot = jnp.zeros((b, branching[0]), jnp.int32)
    for d, width in enumerate(branching[1:], start=1):
        logp, state = expand(state, frontier_tok, parent_slot, d)
        child_logp, child_tok = jax.lax.top_k(logp.astype(jnp.float32), width)  # [B, F, width]
        f = frontier_tok.shape[1]
        frontier_score = (frontier_score[:, :, None] + child_logp).reshape(b, f * width)
        frontier_tok = child_tok.reshape(b, f * width).astype(jnp.int32)
        parent_slot = jnp.broadcast_to(jnp.arange(f * width, dtype=jnp.int32) // width, (b, f * width))
        all_tokens.append(frontier_tok)
        all_scores.append(frontier_score)
    parents, depths = (jnp.broadcast_to(jnp.asarray(x), (b, shape.size)) for x in shape.arrays())
    tree = DynamicTree(jnp.concatenate(all_tokens, 1), parents, depths, jnp.concatenate(all_scores, 1))
    return tree, state
