"""Lookahead decoding (Fu et al. 2024): Jacobi iterations make n-grams, the same forward verifies earlier ones.

No second model and no training. Each step feeds the target, in one forward:

- the verification branch: up to G candidate continuations of the pending token, (N - 1) tokens
  each, taken from an n-gram pool keyed on their first token, merged into a trie (a draft tree,
  node 0 the pending token) and verified by jspec's exact rules. The candidates are deterministic
  drafts, so at any temperature the multi-draft rule keeps the target's distribution;
- the lookahead branch: a window of W columns by (N - 1) levels of Jacobi guesses, fed as
  :class:`jspec.drafters.base.Lookahead` tokens (scored, never verified). Token (level j, column i)
  is at position i + j + 1 after the pending token and sees the pending token, level 0's columns
  up to its own, and its own column's levels 1 .. j: the text ``l0[0..i], l1[i], .., lj[i]``.

After the forward, each column's levels and the target's greedy output at its top level form an
n-gram ``(l0[i], .., l_{N-2}[i], out[i])``; the pool keeps it (keyed on ``l0[i]``) unless it holds it
already, replacing its oldest entry when full. The window drops level 0 and takes the outputs as
its new top level (one Jacobi iteration). With ``prompt_ngrams`` the pool starts with the prompt's
own n-grams, and with ``output_ngrams`` it takes in the n-grams of the text each step adds (the
authors' implementation can do both); without them, the pool holds Jacobi n-grams only.

Everything is per row (batch > 1 keeps a pool and a window per row) and of static shape:
the pool is int32[B, P] keys and int32[B, P, N - 1] continuations with a write pointer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core.sampling import SamplingParams
from jspec.drafters.base import Context, Feedback, Lookahead, TreeProposal

__all__ = ["LookaheadDecoding", "window_mask"]


def window_mask(window: int, levels: int) -> np.ndarray:
    """bool[E, 1 + E] (E = levels * window, level-major): which of (the pending token, the window's
    tokens) window token (j, i) sees. The verification branch's candidates are never seen."""
    e = levels * window
    j, i = np.divmod(np.arange(e), window)  # each token's level and column
    jj, ii = j[None, :], i[None, :]
    sees = ((jj == 0) & (ii <= i[:, None])) | ((jj >= 1) & (jj <= j[:, None]) & (ii == i[:, None]))
    return np.concatenate([np.ones((e, 1), bool), sees], axis=1)


@struct.dataclass
class PoolState:
    """Per row: the Jacobi window, the n-gram pool and its write pointer, steps taken."""

    window: jax.Array  # int32[B, L, W], level 0 oldest
    keys: jax.Array  # int32[B, P], an n-gram's first token; -1 where empty
    grams: jax.Array  # int32[B, P, L], the n - 1 tokens after it
    write: jax.Array  # int32[B], the next slot to write (the oldest entry once full)
    steps: jax.Array  # int32[B], Jacobi iterations so far


@struct.dataclass(kw_only=True)
class LookaheadDecoding:
    """Lookahead decoding. ``window`` W, ``level`` N (n-gram size; the window has N - 1 levels),
    ``guesses`` G (candidates verified per step), ``pool_size`` P (n-grams kept per row). The
    defaults (1, 2, 2) are :data:`jspec.methods.DEFAULTS`: what measured fastest on a 2-core CPU."""

    window: int = struct.field(pytree_node=False, default=1)
    level: int = struct.field(pytree_node=False, default=2)
    guesses: int = struct.field(pytree_node=False, default=2)
    pool_size: int = struct.field(pytree_node=False, default=256)
    prompt_ngrams: bool = struct.field(pytree_node=False, default=True)
    output_ngrams: bool = struct.field(pytree_node=False, default=True)
    hidden_layers = ()

    def __post_init__(self):
        for name, least in (("window", 1), ("level", 2), ("guesses", 1), ("pool_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"lookahead {name} must be a whole number >= {least}; got {value!r}.")
        if self.guesses > self.pool_size:
            raise ValueError(f"lookahead guesses ({self.guesses}) cannot exceed the pool's {self.pool_size} n-grams.")

    @property
    def levels(self) -> int:
        return self.level - 1

    @property
    def num_draft(self) -> int:
        return self.levels

    @property
    def num_nodes(self) -> int:
        return 1 + self.guesses * self.levels

    @property
    def num_lookahead(self) -> int:
        return self.window * self.levels

    def init(self, prompts, ctx: Context, capacity: int, sampling: SamplingParams, hidden: tuple):
        b, p = prompts.shape
        lengths = jnp.maximum(ctx.cache_length, 1)
        spots = (7 * jnp.arange(self.num_lookahead) + 3)[None, :] % lengths[:, None]  # prompt tokens as first guesses
        window = jnp.take_along_axis(prompts, spots, axis=1).reshape(b, self.levels, self.window)
        state = PoolState(
            window=window.astype(jnp.int32),
            keys=jnp.full((b, self.pool_size), -1, jnp.int32),
            grams=jnp.zeros((b, self.pool_size, self.levels), jnp.int32),
            write=jnp.zeros((b,), jnp.int32),
            steps=jnp.zeros((b,), jnp.int32),
        )
        if not self.prompt_ngrams or p + 1 < self.level:
            return state
        # the prompt's n-grams, latest last, then the pending token's: (n - 1) tokens after each first token
        starts = jnp.broadcast_to(jnp.arange(p + 2 - self.level)[None], (b, p + 2 - self.level))
        ok = starts + self.level <= ctx.length[:, None]
        return jax.vmap(self._insert)(state, *self._text_ngrams(ctx.history, starts, ok))

    def propose(self, state: PoolState, ctx: Context, key, sampling: SamplingParams):
        b, g, lv = ctx.last.shape[0], self.guesses, self.levels
        cand, valid = jax.vmap(self._lookup)(state, ctx.last)  # [B, G, L], [B, G]
        same = cand[:, :, None, :] == cand[:, None, :, :]  # [B, G, G', L]
        prefix = jnp.cumprod(same, axis=-1).astype(bool) & valid[:, None, :, None]
        first = jnp.argmax(prefix, axis=2)  # [B, G, L]: the first candidate with the same prefix through depth d
        used = (first == jnp.arange(g)[None, :, None]) & valid[:, :, None]
        node = 1 + first * lv + jnp.arange(lv)[None, None, :]  # the node that holds each prefix
        parents = jnp.concatenate([jnp.zeros((b, g, 1), jnp.int32), node[:, :, :-1]], axis=2)
        depths = np.concatenate([[0], np.tile(np.arange(1, lv + 1), g)]).astype(np.int32)
        flat = lambda x: x.reshape(b, g * lv)  # noqa: E731
        proposal = TreeProposal(
            tokens=jnp.concatenate([ctx.last[:, None], flat(cand)], axis=1).astype(jnp.int32),
            parents=jnp.concatenate([jnp.zeros((b, 1), jnp.int32), flat(parents)], axis=1).astype(jnp.int32),
            depths=jnp.broadcast_to(jnp.asarray(depths), (b, self.num_nodes)),
            used=jnp.concatenate([jnp.ones((b, 1), bool), flat(used)], axis=1),
            probs=None,
            has_draft=valid.any(axis=1),
            lookahead=self._window_tokens(state.window),
        )
        return proposal, state

    def _window_tokens(self, window) -> Lookahead:
        b, e = window.shape[0], self.num_lookahead
        j, i = np.divmod(np.arange(e), self.window)
        local = window_mask(self.window, self.levels)  # [E, 1 + E] over the root and the window
        mask = np.zeros((e, self.num_nodes + e), bool)
        mask[:, 0] = local[:, 0]
        mask[:, self.num_nodes :] = local[:, 1:]
        return Lookahead(
            tokens=window.reshape(b, e),
            offsets=jnp.broadcast_to(jnp.asarray(1 + i + j, jnp.int32), (b, e)),
            mask=jnp.broadcast_to(jnp.asarray(mask), (b, e, self.num_nodes + e)),
        )

    def _lookup(self, state: PoolState, pending):
        """One row: the G most recently stored continuations of ``pending`` [G, L] and which exist [G]."""
        age = (jnp.arange(self.pool_size) - state.write) % self.pool_size  # larger: written later
        score = jnp.where(state.keys == pending, age, -1)
        best, slot = jax.lax.top_k(score, self.guesses)
        return state.grams[slot], best >= 0

    def _insert(self, state: PoolState, keys, grams, ok):
        """One row: stores the n-grams (``keys`` [S], ``grams`` [S, L]) where ``ok`` and not held yet, in order."""

        def put(s: PoolState, item):
            k, gram, go = item
            held = jnp.any((s.keys == k) & jnp.all(s.grams == gram[None], axis=1))
            go = go & ~held
            slot = s.write
            keys_ = jnp.where(go, s.keys.at[slot].set(k), s.keys)
            grams_ = jnp.where(go, s.grams.at[slot].set(gram), s.grams)
            write = jnp.where(go, (slot + 1) % self.pool_size, slot)
            return PoolState(s.window, keys_, grams_, write, s.steps), None

        state, _ = jax.lax.scan(put, state, (keys, grams, ok))
        return state

    def _text_ngrams(self, history, starts, ok):
        """The text's n-grams starting at ``starts`` int32[B, S] where ``ok`` (and the start is in the
        text): (first tokens [B, S], continuations [B, S, N - 1], which to store [B, S])."""
        idx = jnp.maximum(starts[:, :, None] + jnp.arange(self.level)[None, None, :], 0)
        grams = jnp.take_along_axis(history[:, None, :], idx, axis=2)
        return grams[:, :, 0], grams[:, :, 1:], ok & (starts >= 0)

    def _new_text_ngrams(self, ctx: Context, num_accepted):
        """The n-grams that end in this step's new tokens (the accepted drafts and the new pending
        token), oldest first: at most N of them end in the N - 1 drafts and the pending token."""
        ends = ctx.length[:, None] - 1 - self.levels + jnp.arange(self.levels + 1)[None, :]  # [B, N]
        new = ends >= (ctx.length - 1 - num_accepted)[:, None]
        return self._text_ngrams(ctx.history, ends - self.levels, new)

    def commit(self, state: PoolState, ctx: Context, feedback: Feedback):
        if feedback.lookahead_logits is None:  # no window was fed (not a step of this drafter's)
            return state
        b, lv, w = state.window.shape
        out = jnp.argmax(feedback.lookahead_logits, axis=-1).astype(jnp.int32).reshape(b, lv, w)
        top = out[:, -1]  # [B, W], the next Jacobi level
        grams = jnp.concatenate([jnp.swapaxes(state.window[:, 1:], 1, 2), top[:, :, None]], axis=2)  # [B, W, L]
        ripe = state.steps >= lv - 1  # every level above 0 came from the target's outputs
        ok = jnp.broadcast_to(ripe[:, None], (b, w))
        state = jax.vmap(self._insert)(state, state.window[:, 0], grams, ok)
        if self.output_ngrams:
            state = jax.vmap(self._insert)(state, *self._new_text_ngrams(ctx, feedback.num_accepted))
        window = jnp.concatenate([state.window[:, 1:], top[:, None]], axis=1)
        return PoolState(window, state.keys, state.grams, state.write, state.steps + 1)
