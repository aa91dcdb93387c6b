"""Medusa drafting: K heads (:mod:`jspec.heads.medusa`) read the target's last hidden state once per step.

A chain: head i's draft for the token i after the pending one, drawn from its own distribution
(at the request's temperature; greedy picks its top token). A static tree ("Medusa choices",
``StaticTree.from_branching([k1, k2, ...])``): the children of every node at depth d are head
d's k_d most likely tokens, the same below every parent (a head does not see the drafts before
it), deterministic, so the tree is verified without V-sized work per node. Verification is
jspec's exact rule; Medusa's "typical acceptance" is not exact and is not offered.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jspec.core.sampling import SamplingParams, probs_from_logits, sample
from jspec.core.tree import MeasuredTree, StaticTree, frontier_sizes
from jspec.drafters.base import ChainProposal, Context, Feedback, TreeProposal, draft_depth
from jspec.heads.formats import load_medusa_heads
from jspec.heads.medusa import MedusaHeads, saved_rank_rates

__all__ = ["MedusaDrafter", "best_branching", "expected_accepted"]


def expected_accepted(rates, branching) -> float:
    """Tokens a Medusa tree of this branching accepts per step beyond the bonus token, expected from
    measured rank rates (``rates[d, i]``: how often head d's i-th most likely token is the target's),
    with the heads taken as independent (as Medusa's paper does): sum over depths of the product of
    each level's chance to hold the target's token."""
    rates = np.asarray(rates, np.float64)
    alive, total = 1.0, 0.0
    for d, k in enumerate(branching):
        alive *= float(rates[d, :k].sum())
        total += alive
    return total


def best_branching(rates, max_nodes: int) -> tuple[int, ...]:
    """The branching (k_1, ..., k_d) whose Medusa tree, at most ``max_nodes`` nodes with the root, has
    the most expected accepted tokens (:func:`expected_accepted`) for measured rank rates float[K, W]."""
    rates = np.asarray(rates, np.float64)
    if rates.ndim != 2 or not rates.size or (rates < 0).any() or (rates.sum(1) > 1 + 1e-6).any():
        raise ValueError(f"rank rates must be float[K, W] of frequencies (each row summing to at most 1); got "
                         f"shape {rates.shape}.")  # fmt: skip
    if max_nodes < 2:
        raise ValueError(f"a tree needs max_nodes >= 2 (the root and one draft); got {max_nodes}.")
    best = ((), 0.0)

    def grow(branching, width, used):
        nonlocal best
        value = expected_accepted(rates, branching)
        if branching and value > best[1] + 1e-12:
            best = (branching, value)
        if len(branching) == rates.shape[0]:
            return
        for k in range(1, rates.shape[1] + 1):
            if used + width * k > max_nodes - 1:
                break
            grow((*branching, k), width * k, used + width * k)

    grow((), 1, 0)
    return best[0]


@struct.dataclass(kw_only=True)
class MedusaDrafter:
    """A drafter over Medusa heads. Build it with :meth:`from_heads`.

    Attributes:
      weights: the heads' NNX state, the target's frozen output layer and final norm included.
      graphdef: the heads' NNX graph (static).
      num_draft: N (a tree's depth), at most the number of heads.
      hidden_layers: the target's last layer, whose output the heads read.
      tree: None (a chain) or a :class:`jspec.core.tree.StaticTree` from ``from_branching``.
    """

    weights: nnx.State
    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    num_draft: int = struct.field(pytree_node=False)
    hidden_layers: tuple[int, ...] = struct.field(pytree_node=False)
    tree: StaticTree | None = struct.field(pytree_node=False, default=None)
    num_lookahead = 0

    @property
    def num_nodes(self) -> int | None:
        return None if self.tree is None else self.tree.size

    @classmethod
    def from_heads(cls, heads: MedusaHeads | str | os.PathLike, target, *, num_draft: int | None = None,
                   tree: StaticTree | MeasuredTree | None = None, rates=None) -> MedusaDrafter:  # fmt: skip
        """The drafter for ``target``: a chain of ``num_draft`` (default: every head), or a static tree.

        A :class:`jspec.core.tree.MeasuredTree` becomes the static tree of :func:`best_branching` for
        ``rates`` (float[K, W], :func:`jspec.training.medusa.rank_rates`), by default the rates
        saved with the heads' folder.

        Raises:
          ValueError: heads for another target, a folder without Medusa heads, N above the number of
            heads, or a tree deeper than the heads (a depth that refers to a head that does not exist).
        """
        if not isinstance(heads, MedusaHeads):
            if not isinstance(heads, str | os.PathLike):
                raise ValueError(f"heads must be MedusaHeads or the folder of saved ones; got {type(heads).__name__}.")
            if isinstance(tree, MeasuredTree) and rates is None:
                rates = saved_rank_rates(heads)
            heads = load_medusa_heads(heads, target)
        k = heads.config.num_heads
        if isinstance(tree, MeasuredTree):
            if rates is None:
                raise ValueError("a measured tree needs the heads' rank rates: pass rates= (jspec.training.medusa."
                                 "rank_rates) or the heads' folder, where jspec train medusa saves them.")  # fmt: skip
            if num_draft is not None:
                raise ValueError("num_draft conflicts with a measured tree, whose depth is chosen from the rates.")
            rates = np.asarray(rates)
            if rates.shape[0] != k:
                raise ValueError(f"the rank rates are for {rates.shape[0]} heads; these heads are {k}.")
            tree = StaticTree.from_branching(best_branching(rates, tree.max_nodes))
        if tree is not None:
            if not isinstance(tree, StaticTree):
                raise ValueError(
                    f"Medusa drafts static trees (StaticTree.from_branching); got {type(tree).__name__}. The "
                    "heads do not see the drafts before them, so a dynamic tree has nothing to expand."
                )
            frontier_sizes(tree)  # refuses a static tree not made by from_branching
            if tree.max_depth > k:
                raise ValueError(f"the tree is {tree.max_depth} deep, but there are only {k} Medusa heads: depth d "
                                 f"takes head d's tokens. Use at most {k} levels.")  # fmt: skip
        n = draft_depth(k if num_draft is None and tree is None else num_draft, tree)
        if n > k:
            raise ValueError(f"num_draft={n} needs {n} Medusa heads; these are {k}. Draft at most {k}.")
        h, t = heads.config, target.config
        if (h.hidden_size, h.vocab_size, h.num_target_layers) != (t.hidden_size, t.vocab_size, t.num_layers):
            raise ValueError("these Medusa heads were built for another target (hidden size, vocabulary or layers).")
        graphdef, weights = nnx.split(heads)
        return cls(weights=weights, graphdef=graphdef, num_draft=n, hidden_layers=(heads.config.hidden_layer,),
                   tree=tree)  # fmt: skip

    def init(self, prompts, ctx: Context, capacity: int, sampling: SamplingParams, hidden: tuple):
        # The prompt's last token: the target's output there gave the pending token.
        last = jnp.maximum(ctx.cache_length - 1, 0)
        return jnp.take_along_axis(hidden[0], last[:, None, None], axis=1)[:, 0]

    def propose(self, state, ctx: Context, key, sampling: SamplingParams):
        heads = nnx.merge(self.graphdef, self.weights)
        logits = heads.logits(state)[:, : self.num_draft]  # [B, N, V]
        if self.tree is not None:
            return self._tree(logits, ctx), state
        probs = probs_from_logits(logits, sampling)
        tokens = jnp.stack([sample(jax.random.fold_in(key, i), probs[:, i]) for i in range(self.num_draft)], axis=1)
        tokens = tokens.astype(jnp.int32)
        conf = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), tokens[:, :, None], axis=-1)[:, :, 0]
        return ChainProposal(tokens, probs, None, confidence=conf), state

    def _tree(self, logits, ctx: Context) -> TreeProposal:
        parents, depths = self.tree.arrays()
        rank = np.zeros(len(parents), np.int32)  # each node's place among its siblings
        for j in range(1, len(parents)):
            rank[j] = sum(parents[i] == parents[j] for i in range(1, j))
        width = int(rank.max()) + 1
        _, top = jax.lax.top_k(logits, width)  # [B, N, width]
        b = logits.shape[0]
        head_of = np.maximum(depths - 1, 0)
        tokens = top[:, head_of, rank]  # [B, T]
        tokens = jnp.where(jnp.arange(len(parents))[None] == 0, ctx.last[:, None], tokens).astype(jnp.int32)
        bcast = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32)[None], (b, len(parents)))  # noqa: E731
        used = jnp.ones((b, len(parents)), bool)
        return TreeProposal(tokens, bcast(parents), bcast(depths), used, None, None)

    def commit(self, state, ctx: Context, feedback: Feedback):
        """The target's last-layer output at the last accepted token (the one that gave the new pending token)."""
        return jnp.take_along_axis(feedback.hidden[0], feedback.num_accepted[:, None, None], axis=1)[:, 0]
