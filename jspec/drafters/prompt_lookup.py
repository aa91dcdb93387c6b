"""Prompt lookup (n-gram) drafting: no model, the text's own earlier continuations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jspec.core.sampling import SamplingParams
from jspec.core.tree import StaticTree
from jspec.drafters.base import ChainProposal, Context, Feedback, TreeProposal

__all__ = ["PromptLookup"]


@struct.dataclass(kw_only=True)
class PromptLookup:
    """Prompt lookup (n-gram) drafting: continue the latest earlier match of the text's last n tokens.

    Tries n = max_ngram down to min_ngram and takes the longest suffix that
    occurred before; the draft is what followed it (as far as the text goes).
    No model, so the drafts are deterministic (verified as one-hot distributions). The
    default min_ngram of 2 skips matches of one repeated token, which are accepted
    far less often than longer ones (measured: docs/log, prompt lookup n-grams).

    With ``num_paths`` > 1 it drafts a tree: the continuations of up to that
    many matches (longer n-grams first, then later ones) whose first tokens
    differ, each a path of ``num_draft`` tokens from the root.
    """

    num_draft: int = struct.field(pytree_node=False, default=4)
    max_ngram: int = struct.field(pytree_node=False, default=3)
    min_ngram: int = struct.field(pytree_node=False, default=2)
    num_paths: int = struct.field(pytree_node=False, default=1)
    hidden_layers = ()
    num_lookahead = 0

    def __post_init__(self):
        if self.num_draft < 1:
            raise ValueError(f"num_draft must be >= 1; got {self.num_draft}.")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got {self.min_ngram}, {self.max_ngram}.")
        if self.num_paths < 1:
            raise ValueError(f"num_paths must be >= 1; got {self.num_paths}.")

    @property
    def num_nodes(self) -> int | None:
        return 1 + self.num_paths * self.num_draft if self.num_paths > 1 else None

    def init(self, prompts, ctx: Context, capacity: int, sampling: SamplingParams, hidden: tuple):
        return ()

    def propose(self, state, ctx: Context, key, sampling: SamplingParams):
        if self.num_paths > 1:
            return self._propose_tree(ctx), state
        tokens, count = jax.vmap(self._lookup_row)(ctx.history, ctx.length)
        return ChainProposal(tokens, None, count > 0, num_drafts=count), state

    def _match_scores(self, history, length):
        """int32[C]: for each end position, (n - 1) * C + end where the text's last n tokens match
        the n tokens ending there (the longest n counted), else -1."""
        c = history.shape[0]
        idx = jnp.arange(c)
        score = jnp.full((c,), -1, jnp.int32)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            match = (idx >= n - 1) & (idx <= length - 2) & (length >= n + 1)
            for k in range(n):
                suffix_tok = history[jnp.maximum(length - 1 - k, 0)]
                match &= jnp.roll(history, k) == suffix_tok  # history[idx - k]
            score = jnp.where((score < 0) & match, (n - 1) * c + idx, score)
        return score

    def _lookup_row(self, history, length):
        """One row: (draft int32[N], how many of its N slots the continuation fills: 0 without a match)."""
        c = history.shape[0]
        score = self._match_scores(history, length)
        best_end = jnp.where(score.max() >= 0, jnp.argmax(score), -1)
        start = best_end + 1
        pos = start + jnp.arange(self.num_draft)
        valid = (best_end >= 0) & (pos < length)
        draft = jnp.where(valid, history[jnp.clip(pos, 0, c - 1)], 0).astype(jnp.int32)
        return draft, jnp.sum(valid).astype(jnp.int32)

    def _tree_row(self, history, length):
        """One row: (tokens int32[M, N], used bool[M, N]) for M = num_paths continuations."""
        c, m, n = history.shape[0], self.num_paths, self.num_draft
        score = self._match_scores(history, length)
        first = history[jnp.clip(jnp.arange(c) + 1, 0, c - 1)]
        ends = []
        for _ in range(m):
            end = jnp.where(score.max() >= 0, jnp.argmax(score), -1)
            ends.append(end)
            score = jnp.where((end >= 0) & (first == first[jnp.maximum(end, 0)]), -1, score)
        ends = jnp.stack(ends)  # [M]
        pos = ends[:, None] + 1 + jnp.arange(n)[None, :]
        used = (ends[:, None] >= 0) & (pos < length)
        tokens = jnp.where(used, history[jnp.clip(pos, 0, c - 1)], 0).astype(jnp.int32)
        return tokens, used

    def _propose_tree(self, ctx: Context) -> TreeProposal:
        b, m, n = ctx.history.shape[0], self.num_paths, self.num_draft
        tree = StaticTree.from_branching([m] + [1] * (n - 1))
        paths, used = jax.vmap(self._tree_row)(ctx.history, ctx.length)  # [B, M, N]
        # from_branching([M, 1, ...]) numbers depth 1 first (nodes 1..M), then depth 2, ...: node
        # 1 + d * M + i is path i's token at depth d + 1.
        tokens = jnp.concatenate([ctx.last[:, None], jnp.swapaxes(paths, 1, 2).reshape(b, m * n)], axis=1)
        used = jnp.concatenate([jnp.ones((b, 1), bool), jnp.swapaxes(used, 1, 2).reshape(b, m * n)], axis=1)
        parents, depths = (jnp.broadcast_to(jnp.asarray(x), (b, tree.size)) for x in tree.arrays())
        return TreeProposal(tokens.astype(jnp.int32), parents, depths, used, None, used[:, 1])

    def commit(self, state, ctx: Context, feedback: Feedback):
        return state
