"""Chain drafters behind one small interface.

A drafter is a frozen, hashable object (a static argument of the engine's
jit) holding only static facts; its arrays (a draft model's weights and KV
cache) travel in a pytree ``state`` that the engine threads through the loop
without looking inside. Two attributes and three methods:

* ``num_draft``: N; ``hidden_layers``: the target layers whose hidden states
  the drafter reads (``()`` for most; EAGLE heads name theirs).
* ``init(weights, prompts, ctx, capacity, sampling, hidden) -> state``: prefill.
* ``propose(weights, state, ctx, key, sampling) -> (Proposal, state)``: N
  draft tokens per row with the distributions they were drawn from.
* ``commit(weights, state, ctx, num_accepted, hidden) -> state``: keep what
  the target accepted, forget the rest.

``ctx`` is a :class:`Context` the engine fills: the token history per row
(prompt and generated text, the pending token included) and its length.
``hidden`` is the tuple of the target's hidden states [B, T, H] at the
``hidden_layers``, from the forward the engine just ran (the prompt at
``init``; the pending token and the N drafts, or the pending token alone,
at ``commit``): the target hands them over, the drafter never calls it.

A tree drafter also has ``num_nodes`` (the tree's node budget, root
included) and proposes a :class:`TreeProposal`; ``num_draft`` is then the
deepest node's depth. At ``commit`` it sees the accepted path as if it had
been a chain: the hidden states are gathered along the path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jspec.sampling import SamplingParams, probs_from_logits, sample

__all__ = ["Context", "DraftModel", "PromptLookup", "Proposal", "TreeProposal"]


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
        return jnp.take_along_axis(self.history, (self.length - 1)[:, None], axis=1)[:, 0]


@struct.dataclass
class Proposal:
    """Attributes:
    tokens: int32[B, N], the drafts.
    probs: float32[B, N, V], the distributions they were drawn from (one-hot
      rows for deterministic drafters).
    has_draft: bool[B], whether the row has anything worth verifying; when no
      row has, the engine takes a plain one-token step instead.
    """

    tokens: jax.Array
    probs: jax.Array
    has_draft: jax.Array


@struct.dataclass
class TreeProposal:
    """A draft tree per row (see :mod:`jspec.tree`); node 0 is the pending token.

    A tree drafter has ``num_nodes`` (T, static) and ``num_draft`` (the deepest
    node's depth: the most drafts one step can accept).

    Attributes:
      tokens: int32[B, T].
      parents: int32[B, T], parents before children, the root's parent 0.
      depths: int32[B, T].
      used: bool[B, T], nodes to verify (the root's flag is ignored).
      probs: float32[B, T, V], per node the distribution it was drawn from
        (the root's row is ignored), or None when every child was chosen
        deterministically (one-hot rows, verified without V-sized work per node).
      has_draft: bool[B].
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    used: jax.Array
    probs: jax.Array
    has_draft: jax.Array


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Prompt lookup (n-gram) drafting: continue the latest earlier match of the text's last n tokens.

    Tries n = max_ngram down to min_ngram and takes the longest suffix that
    occurred before; the draft is what followed it (as far as the text goes).
    No model, so the drafts are deterministic (one-hot distributions). The
    default min_ngram of 2 skips matches of one repeated token: on SmolLM2 and
    HumanEval they were accepted a third as often as longer ones and made a
    verify step cost more than it gained (BENCHMARKS.md, prompt lookup n-grams).

    With ``num_paths`` > 1 it drafts a tree: the continuations of up to that
    many matches (longer n-grams first, then later ones) whose first tokens
    differ, each a path of ``num_draft`` tokens from the root.
    """

    num_draft: int
    vocab_size: int
    max_ngram: int = 3
    min_ngram: int = 2
    num_paths: int = 1
    hidden_layers = ()

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

    def init(self, weights, prompts, ctx, capacity, sampling, hidden):
        return ()

    def propose(self, weights, state, ctx: Context, key, sampling: SamplingParams):
        if self.num_paths > 1:
            return self._propose_tree(ctx), state
        tokens, has = jax.vmap(self._lookup_row)(ctx.history, ctx.length)
        probs = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        return Proposal(tokens, probs, has), state

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
        """One row: (draft int32[N], found bool)."""
        c = history.shape[0]
        score = self._match_scores(history, length)
        best_end = jnp.where(score.max() >= 0, jnp.argmax(score), -1)
        start = best_end + 1
        pos = start + jnp.arange(self.num_draft)
        valid = (best_end >= 0) & (pos < length)
        draft = jnp.where(valid, history[jnp.clip(pos, 0, c - 1)], 0).astype(jnp.int32)
        return draft, best_end >= 0

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
        from jspec.tree import StaticTree

        b, m, n = ctx.history.shape[0], self.num_paths, self.num_draft
        tree = StaticTree.from_branching([m] + [1] * (n - 1))
        paths, used = jax.vmap(self._tree_row)(ctx.history, ctx.length)  # [B, M, N]
        # from_branching([M, 1, ...]) numbers depth 1 first (nodes 1..M), then depth 2, ...: node
        # 1 + d * M + i is path i's token at depth d + 1.
        tokens = jnp.concatenate([ctx.last[:, None], jnp.swapaxes(paths, 1, 2).reshape(b, m * n)], axis=1)
        used = jnp.concatenate([jnp.ones((b, 1), bool), jnp.swapaxes(used, 1, 2).reshape(b, m * n)], axis=1)
        parents, depths = (jnp.broadcast_to(jnp.asarray(x), (b, tree.size)) for x in tree.arrays())
        return TreeProposal(tokens.astype(jnp.int32), parents, depths, used, None, used[:, 1])

    def commit(self, weights, state, ctx, num_accepted, hidden):
        return state


@struct.dataclass
class _DraftModelState:
    cache: object  # the draft model's KVCache
    pending: jax.Array  # int32[B]: a token accepted last step that the draft model has not seen, or -1
    tree_tokens: jax.Array | None = None  # int32[B, T]: a tree drafter's last tree, read back at commit


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A separate, smaller model with the target's tokenizer, unrolled N steps with ``lax.scan``.

    ``weights`` (the engine passes them through) is the model's NNX state;
    ``graphdef`` is static. Its drafts are sampled with the same sampling
    parameters as the target's, and their distributions go to the verifier.
    """

    graphdef: nnx.GraphDef
    num_draft: int
    vocab_size: int
    tree: object = None  # a StaticTree from StaticTree.from_branching, or None for a chain
    hidden_layers = ()

    @classmethod
    def from_model(cls, model: nnx.Module, num_draft: int, target_vocab_size: int, tree=None):
        """(drafter, weights). Raises ValueError when the vocabularies differ.

        With ``tree`` (a :class:`jspec.tree.StaticTree` made by ``from_branching``,
        e.g. [2, 2, 2]) every node's children are the model's most likely tokens
        after it, and ``num_draft`` is the tree's depth.
        """
        vocab = model.config.vocab_size
        if vocab != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({vocab}) differs from the target's ({target_vocab_size}); "
                "a draft model must share the target's tokenizer."
            )
        if tree is not None:
            if getattr(tree, "branching", None) is None:
                raise ValueError("a draft model drafts static trees made by StaticTree.from_branching (e.g. 2,2,2).")
            num_draft = tree.max_depth
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1; got {num_draft}.")
        graphdef, weights = nnx.split(model)
        return cls(graphdef, num_draft, vocab, tree), weights

    @property
    def num_nodes(self) -> int | None:
        return None if self.tree is None else self.tree.size

    def init(self, weights, prompts, ctx, capacity, sampling, hidden):
        model = nnx.merge(self.graphdef, weights)
        lengths = ctx.cache_length
        b, p = prompts.shape
        cache = model.init_cache(b, capacity)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        # The same prompt the target prefilled; the target's first sample is the pending token.
        out = model(prompts, positions, cache, num_new=lengths, logit_index=lengths - 1)
        tree_tokens = None if self.tree is None else jnp.zeros((b, self.tree.size), jnp.int32)
        return _DraftModelState(out.cache, jnp.full((b,), -1, jnp.int32), tree_tokens)

    def propose(self, weights, state: _DraftModelState, ctx: Context, key, sampling: SamplingParams):
        model = nnx.merge(self.graphdef, weights)
        b = ctx.history.shape[0]
        last = ctx.last
        cache = state.cache
        # Catch up: feed [pending, last] where a row has a token the model has not seen
        # (all drafts were accepted last step), else only last; a two-token forward
        # costs more than a one-token one, so it runs only when some row needs it.
        has_pending = state.pending >= 0

        def catch_up(cache):
            first = jnp.stack([jnp.where(has_pending, state.pending, last), last], axis=1)
            positions = cache.lengths[:, None] + jnp.arange(2)[None, :]
            n_new = 1 + has_pending.astype(jnp.int32)
            out = model(first, positions, cache, num_new=n_new, logit_index=n_new - 1)
            return out.logits[:, 0], out.cache

        def one_token(cache):
            out = model(last[:, None], cache.lengths[:, None], cache)
            return out.logits[:, 0], out.cache

        logits0, cache = jax.lax.cond(jnp.any(has_pending), catch_up, one_token, cache)
        if self.tree is not None:
            return self._propose_tree(model, cache, ctx, logits0, state.pending)
        probs0 = probs_from_logits(logits0, sampling)
        tok0 = sample(jax.random.fold_in(key, 0), probs0)

        def step(carry, i):
            cache, tok = carry
            o = model(tok[:, None], cache.lengths[:, None], cache)
            p = probs_from_logits(o.logits[:, 0], sampling)
            nxt = sample(jax.random.fold_in(key, i), p)
            return (o.cache, nxt), (nxt, p)

        (cache, _), (toks, probs) = jax.lax.scan(step, (cache, tok0), jnp.arange(1, self.num_draft))
        tokens = jnp.concatenate([tok0[:, None], jnp.moveaxis(toks, 0, 1)], axis=1)
        probs = jnp.concatenate([probs0[:, None], jnp.moveaxis(probs, 0, 1)], axis=1)
        proposal = Proposal(tokens.astype(jnp.int32), probs, jnp.ones((b,), bool))
        return proposal, _DraftModelState(cache, state.pending, state.tree_tokens)

    def _propose_tree(self, model, cache, ctx: Context, logits0, pending):
        """The static tree filled with the model's top choices (deterministic children: ``probs`` None).

        The pending token sits in the cache at ``ctx.cache_length``; every node above the last
        depth is fed once, in node order, to the slots after it (node i at ``ctx.cache_length + i``),
        each seeing the committed text and its own ancestors.
        """
        from jspec.tree import grow_static_tree, tree_attention_mask

        branching = list(self.tree.branching)
        fed = sum(self.tree.fed_per_depth)  # nodes above the last depth
        b = ctx.history.shape[0]
        base = cache.lengths  # the first slot after the pending token

        def expand(carry, tokens, parent_slot, d):
            cache, ancestors, offset = carry
            f = tokens.shape[1]
            own = jax.nn.one_hot(offset + jnp.arange(f), fed, dtype=bool)  # [F, W]
            ancestors = jnp.take_along_axis(ancestors, parent_slot[:, :, None], axis=1) | own[None]
            mask = tree_attention_mask(base, ancestors, cache.capacity)
            positions = jnp.broadcast_to((ctx.cache_length + d)[:, None], (b, f))
            out = model(tokens, positions, cache, mask)
            return jax.nn.log_softmax(out.logits, axis=-1), (out.cache, ancestors, offset + f)

        carry = (cache, jnp.zeros((b, 1, fed), bool), 0)
        tree, (cache, _, _) = grow_static_tree(expand, carry, ctx.last, jax.nn.log_softmax(logits0, -1), branching)
        tokens = tree.tokens  # node 0 is ctx.last, the root it was grown from
        used = jnp.ones_like(tokens, bool)
        proposal = TreeProposal(tokens, tree.parents, tree.depths, used, None, jnp.ones((b,), bool))
        return proposal, _DraftModelState(cache, pending, tokens)

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

    def commit(self, weights, state: _DraftModelState, ctx: Context, num_accepted, hidden):
        """``ctx`` is the context after the step: the accepted drafts and the new pending token appended.

        The draft cache holds the old pending token and drafts 1..N-1, so it
        agrees with the committed text up to ``ctx.cache_length`` unless all N
        drafts were accepted: the last draft was never fed, and becomes the
        next step's catch-up token.
        """
        if self.tree is not None:
            return self._commit_tree(state, ctx, num_accepted)
        all_in = num_accepted >= self.num_draft
        lengths = ctx.cache_length - all_in.astype(jnp.int32)
        last_draft = jnp.take_along_axis(ctx.history, jnp.maximum(ctx.length - 2, 0)[:, None], axis=1)[:, 0]
        pending = jnp.where(all_in, last_draft, -1)
        return _DraftModelState(state.cache.rollback(lengths), pending, state.tree_tokens)
