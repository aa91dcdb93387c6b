"""Medusa drafting: K heads (:mod:`jspec.medusa`) read the target's last hidden state once per step.

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

from jspec.drafters.base import ChainProposal, Context, Feedback, TreeProposal, draft_depth
from jspec.medusa import MedusaHeads, load_medusa
from jspec.sampling import SamplingParams, probs_from_logits, sample
from jspec.tree import StaticTree, frontier_sizes

__all__ = ["MedusaDrafter"]


@struct.dataclass(kw_only=True)
class MedusaDrafter:
    """A drafter over Medusa heads. Build it with :meth:`from_heads`.

    Attributes:
      weights: the heads' NNX state, the target's frozen output layer and final norm included.
      graphdef: the heads' NNX graph (static).
      num_draft: N (a tree's depth), at most the number of heads.
      hidden_layers: the target's last layer, whose output the heads read.
      tree: None (a chain) or a :class:`jspec.tree.StaticTree` from ``from_branching``.
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
                   tree: StaticTree | None = None) -> MedusaDrafter:  # fmt: skip
        """The drafter for ``target``: a chain of ``num_draft`` (default: every head), or a static tree.

        Raises:
          ValueError: heads for another target, a folder without Medusa heads, N above the number of
            heads, or a tree deeper than the heads (a depth that refers to a head that does not exist).
        """
        if not isinstance(heads, MedusaHeads):
            if not isinstance(heads, str | os.PathLike):
                raise ValueError(f"heads must be MedusaHeads or the folder of saved ones; got {type(heads).__name__}.")
            heads = load_medusa(heads, target)
        k = heads.config.num_heads
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
        b = logits.shape[0]
        if self.tree is not None:
            return self._tree(logits, ctx), state
        probs = probs_from_logits(logits, sampling)
        tokens = jnp.stack([sample(jax.random.fold_in(key, i), probs[:, i]) for i in range(self.num_draft)], axis=1)
        tokens = tokens.astype(jnp.int32)
        conf = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), tokens[:, :, None], axis=-1)[:, :, 0]
        return ChainProposal(tokens, probs, jnp.ones((b,), bool), confidence=conf), state

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
        return TreeProposal(tokens, bcast(parents), bcast(depths), used, None, jnp.ones((b,), bool))

    def commit(self, state, ctx: Context, feedback: Feedback):
        """The target's last-layer output at the last accepted token (the one that gave the new pending token)."""
        return jnp.take_along_axis(feedback.hidden[0], feedback.num_accepted[:, None, None], axis=1)[:, 0]
