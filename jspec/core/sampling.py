"""Logits to sampling distributions: temperature, top-k and top-p.

One function, :func:`probs_from_logits`, turns logits into the distribution
that is actually sampled from. The speculative verifier is exact only when the
drafter's distribution ``p`` and the target's ``q`` are the distributions the
two models really sample from, so the engine passes both through this same
function with the same :class:`SamplingParams`.

Axis letters used in shapes across jspec: B batch, T tokens in a forward,
N draft tokens, V vocabulary, S cache slots, L layers, H hidden size.

The knobs are arrays, not static arguments: changing the temperature, top-k or
top-p between calls does not recompile, and a batch may mix them per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = [
    "SamplingParams",
    "check_distribution",
    "is_concrete",
    "probs_from_logits",
    "sample",
    "sample_logits",
]


def is_concrete(x) -> bool:
    """True when ``x`` holds values (not a tracer), so it can be checked on the host."""
    return not isinstance(x, jax.core.Tracer)


@struct.dataclass
class SamplingParams:
    """How logits become a sampling distribution.

    Attributes:
      temperature: float32[...]; 0 means greedy (a one-hot on the argmax).
      top_k: int32[...]; keep the k most likely tokens, 0 keeps all.
      top_p: float32[...]; keep the smallest set of most likely tokens whose
        mass reaches top_p, 1 keeps all.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def create(cls, temperature=1.0, top_k=0, top_p=1.0) -> SamplingParams:
        """Validates the knobs on the host and stores them as arrays.

        Raises:
          ValueError: temperature < 0, top_k < 0 or top_p outside (0, 1].
        """
        validate_sampling(temperature, top_k, top_p)
        # A top_k beyond int32 keeps every token, as any top_k above the vocabulary does.
        if is_concrete(top_k):
            top_k = np.minimum(np.asarray(top_k, np.float64), np.iinfo(np.int32).max).astype(np.int32)
        return cls(
            temperature=jnp.asarray(temperature, jnp.float32),
            top_k=jnp.asarray(top_k, jnp.int32),
            top_p=jnp.asarray(top_p, jnp.float32),
        )

    @classmethod
    def greedy(cls) -> SamplingParams:
        return cls.create(temperature=0.0)


def validate_sampling(temperature, top_k, top_p) -> None:
    """Raises ValueError for knobs that have no meaning; skips traced values."""
    if is_concrete(temperature):
        t = np.asarray(temperature, np.float64)
        if not np.all(np.isfinite(t)) or np.any(t < 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy); got {t.tolist()}.")
        if np.any(t > np.finfo(np.float32).max):  # stored as float32, it would become inf
            raise ValueError(f"temperature {t.max():.3g} is beyond float32's range (3.4e38); any temperature above "
                             "~1e3 already samples almost uniformly.")  # fmt: skip
    if is_concrete(top_k):
        k = np.asarray(top_k)
        if k.dtype.kind not in "iu" and not np.all(k == np.round(k)):
            raise ValueError(f"top_k must be a whole number (0 disables it); got {k.tolist()}.")
        if np.any(k < 0):
            raise ValueError(f"top_k must be >= 0 (0 disables it); got {k.tolist()}.")
    if is_concrete(top_p):
        p = np.asarray(top_p, np.float64)
        if not np.all((p > 0) & (p <= 1)):
            raise ValueError(f"top_p must lie in (0, 1] (1 disables it); got {p.tolist()}.")


def check_distribution(probs, name: str = "probs", atol: float = 1e-3) -> None:
    """Raises ValueError unless every row of ``probs`` is a probability distribution.

    Only concrete arrays are checked; inside ``jit`` this is a no-op, so call it
    on inputs before handing them to jitted code.

    Args:
      probs: float[..., V].
      name: what to call the array in the message.
      atol: allowed deviation of each row's sum from 1.
    """
    if not is_concrete(probs):
        return
    arr = np.asarray(probs, np.float64)
    if arr.ndim == 0:
        raise ValueError(f"{name} must have a vocabulary axis; got a scalar.")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or inf; pass probabilities, not logits.")
    if np.any(arr < 0):
        raise ValueError(f"{name} has negative entries (min {arr.min():.3g}); pass probabilities.")
    sums = arr.sum(-1)
    bad = np.abs(sums - 1.0) > atol
    if np.any(bad):
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} rows must sum to 1 (within {atol}); row {idx} sums to {sums[idx]:.6g}. "
            "Did you pass logits? Use jspec.probs_from_logits first."
        )


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys that order like the float32 values ``x`` (no NaNs): thresholds become exact integers."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key_where(pred, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """The largest key t in [lo, hi] with ``pred(t)``, per row, for a ``pred`` that holds at ``lo``
    and, once false, stays false for larger t. 32 halvings of the uint32 range, each one pass over
    the vocabulary: no sort (XLA's CPU sort of a vocabulary per token was slower than the model)."""

    def halve(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        mid = lo + gap // 2 + gap % 2  # rounds up, so lo moves when pred(mid) holds
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def _top_k_mask(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """Masks all but the top_k largest logits (ties at the k-th value are kept)."""
    vocab = logits.shape[-1]
    keys = _order_keys(logits)
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))
    # The k-th largest key: the largest t with at least k keys >= t.
    kth = _largest_key_where(
        lambda t: jnp.sum(keys >= t[..., None], axis=-1) >= k, keys.min(axis=-1), keys.max(axis=-1)
    )
    return jnp.where(keys < kth[..., None], -jnp.inf, logits)


def _top_p_mask(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keeps the smallest set of most likely tokens whose mass reaches top_p (the top token always;
    tokens tied with the last one kept are kept too)."""
    probs = jax.nn.softmax(logits, axis=-1)
    keys = _order_keys(logits)

    def mass_above(t):  # the probability of the tokens with keys > t
        return jnp.sum(jnp.where(keys > t[..., None], probs, 0.0), axis=-1)

    # Token i is kept when the mass above it is below top_p: keys > t* where t* is the largest
    # t whose mass above still reaches top_p (it holds at the smallest key - 1, where it is 1).
    lo = jnp.maximum(keys.min(axis=-1), 1) - 1
    cut = _largest_key_where(lambda t: mass_above(t) >= top_p, lo, keys.max(axis=-1))
    keep = (keys > cut[..., None]) | (top_p[..., None] >= 1.0)
    return jnp.where(keep, logits, -jnp.inf)


def probs_from_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The distribution sampled from: temperature, then top-k, then top-p.

    Args:
      logits: float[..., V].
      params: knobs broadcastable to ``logits.shape[:-1]``.

    Returns:
      float32[..., V], rows summing to 1. Temperature 0 gives a one-hot on the
      first argmax, whatever top-k and top-p say.
    """
    validate_sampling(params.temperature, params.top_k, params.top_p)
    logits = jnp.asarray(logits, jnp.float32)
    batch_shape = logits.shape[:-1]
    temperature = jnp.broadcast_to(params.temperature, batch_shape)
    top_k = jnp.broadcast_to(params.top_k, batch_shape)
    top_p = jnp.broadcast_to(params.top_p, batch_shape)

    greedy = temperature <= 0
    safe_t = jnp.where(greedy, 1.0, temperature)
    scaled = logits / safe_t[..., None]
    # The threshold searches are the costly part: each runs only when some row asks for it.
    scaled = jax.lax.cond(jnp.any(~greedy & (top_k > 0)), lambda x: _top_k_mask(x, top_k), lambda x: x, scaled)
    scaled = jax.lax.cond(jnp.any(~greedy & (top_p < 1)), lambda x: _top_p_mask(x, top_p), lambda x: x, scaled)
    sampled = jax.nn.softmax(scaled, axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    probs = jnp.where(greedy[..., None], onehot, sampled)
    return jnp.where(_broken(logits)[..., None], jnp.nan, probs)  # a broken row stays visibly broken


INVALID_TOKEN = -1  # what a draw from a broken row gives: never a token id, refused on the host


def _broken(logits: jax.Array) -> jax.Array:
    """Rows holding NaN or +inf (a model's numerical failure; -inf is a legitimate mask)."""
    return jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per row of ``probs`` (float[..., V]) → int32[...].

    Zero-probability tokens are never drawn, so a one-hot row returns its token. A row with a NaN
    (from a model's NaN or +inf logits) gives ``INVALID_TOKEN``, which the decoders refuse on the host.
    """
    logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
    token = jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.any(jnp.isnan(probs), axis=-1), INVALID_TOKEN, token)


def sample_logits(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """One token per row straight from logits (float[..., V]) → int32[...].

    The same draw as ``sample(key, probs_from_logits(logits, params))``, but when
    every row is greedy it only takes the argmax: drawing V Gumbel variables
    per row costs a tenth of a small model's decode step on a CPU.
    """
    greedy = jnp.all(jnp.asarray(params.temperature) <= 0)
    return jax.lax.cond(
        greedy,
        lambda: jnp.where(_broken(logits), INVALID_TOKEN, jnp.argmax(logits, axis=-1)).astype(jnp.int32),
        lambda: sample(key, probs_from_logits(logits, params)),
    )
