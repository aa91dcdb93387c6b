"""Leviathan rejection sampling: the rule that keeps speculative output exact.

Notation (as in the papers): ``p`` is the drafter's distribution, ``q`` the
target's. A draft token ``d ~ p`` is accepted with probability
``min(1, q(d) / p(d))``; at the first rejection a token is drawn from the
normalized residual ``(q - p)+`` and the step ends; when all N drafts pass, a
bonus token is drawn from the target's distribution at position N + 1. Each
emitted token is then distributed exactly as a draw from ``q``.

:func:`verify_chain` works on one sequence; :func:`verify_chain_batch` is its
``jax.vmap`` over a batch, each row with its own key. Deterministic drafts (a
lookup, a greedy pick) pass ``draft_probs=None``: they are verified as one-hot
distributions without building them. :func:`verify_chain_logits` and
:func:`verify_chain_batch_logits` take logits and sampling parameters instead
of probabilities and turn them into distributions inside one compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core.sampling import SamplingParams, check_distribution, is_concrete, probs_from_logits, sample

__all__ = [
    "ChainVerdict",
    "acceptance_probability",
    "residual_distribution",
    "validate_chain_inputs",
    "verify_chain",
    "verify_chain_batch",
    "verify_chain_batch_logits",
    "verify_chain_logits",
]


@struct.dataclass
class ChainVerdict:
    """What one verify step decided for one sequence (add a leading B when batched).

    Attributes:
      tokens: int32[N + 1]; the accepted drafts, then the correction or bonus
        token; slots at and after ``num_emitted`` hold ``pad_id``.
      num_accepted: int32[]; drafts accepted, 0..N.
      num_emitted: int32[]; ``num_accepted + 1``, always at least one token.
      accepted: bool[N]; per draft position, whether it was accepted (False
        after the first rejection).
    """

    tokens: jax.Array
    num_accepted: jax.Array
    num_emitted: jax.Array
    accepted: jax.Array


def acceptance_probability(p_d: jax.Array, q_d: jax.Array) -> jax.Array:
    """min(1, q(d) / p(d)), elementwise; 0 where p(d) = 0.

    A draft its drafter gives probability 0 could not have been drawn from that
    distribution: it is a placeholder or a drafter's bug, and it is rejected (as
    vLLM's sampler does), so the step goes on from the residual. For drafts
    really drawn from p this happens with probability 0, so exactness is kept.
    """
    safe_p = jnp.where(p_d > 0, p_d, 1.0)
    return jnp.where(p_d > 0, jnp.minimum(1.0, q_d / safe_p), 0.0)


def residual_distribution(q: jax.Array, p: jax.Array) -> jax.Array:
    """normalize((q - p)+) over the last axis.

    When ``(q - p)+`` is all zero (q = p), a rejection has probability zero;
    the defined answer is then ``q`` itself, so sampling stays well posed.
    """
    resid = jnp.maximum(q - p, 0.0)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    return jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), q)


def validate_chain_inputs(draft_tokens, draft_probs, target_probs, *, batched: bool) -> None:
    """Shape and value checks with messages that say what to pass instead.

    Shapes are checked always (they are static, so this runs at trace time);
    values only when the arrays are concrete.
    """
    lead = "[B, " if batched else "["
    want_tok = 2 if batched else 1
    d_shape, p_shape, q_shape = (np.shape(x) for x in (draft_tokens, draft_probs, target_probs))
    if len(d_shape) != want_tok:
        raise ValueError(f"draft_tokens must be int {lead}N]; got shape {d_shape}.")
    n = d_shape[-1]
    if n < 1:
        raise ValueError(f"need at least one draft token (N >= 1); got N = {n}.")
    if len(q_shape) != want_tok + 1:
        raise ValueError(f"target_probs must be {lead}N + 1, V]; got shape {q_shape}.")
    if draft_probs is not None and (len(p_shape) != want_tok + 1 or p_shape[:-1] != d_shape):
        raise ValueError(
            f"draft_probs must be {lead}N, V] matching draft_tokens {d_shape}; got {p_shape}. "
            "For drafters that pick tokens deterministically pass None."
        )
    vocab = q_shape[-1] if draft_probs is None else p_shape[-1]
    want_q = (*d_shape[:-1], n + 1, vocab)
    if tuple(q_shape) != want_q:
        raise ValueError(
            f"target_probs must be {lead}N + 1, V] = {want_q} (one row per draft plus the "
            f"bonus position); got {q_shape}."
        )
    if is_concrete(draft_tokens):
        toks = np.asarray(draft_tokens)
        if toks.dtype.kind not in "iu":
            raise ValueError(f"draft_tokens must be integers; got dtype {toks.dtype}.")
        if toks.size and (toks.min() < 0 or toks.max() >= vocab):
            raise ValueError(f"draft_tokens must lie in [0, {vocab}); got values {toks.min()}..{toks.max()}.")
    if draft_probs is not None:
        check_distribution(draft_probs, "draft_probs")
    check_distribution(target_probs, "target_probs")


def _verify_chain(draft_tokens, draft_probs, target_probs, key, pad_id, num_drafts=None):
    n = draft_tokens.shape[0]
    limit = n if num_drafts is None else num_drafts  # drafts at and after the row's count are not drafts
    accept_key, sample_key = jax.random.split(key)

    q_d = jnp.take_along_axis(target_probs[:n], draft_tokens[:, None], axis=-1)[:, 0]
    u = jax.random.uniform(accept_key, (n,))
    if draft_probs is None:  # one-hot p: accept with probability q(d)
        accept = u < acceptance_probability(jnp.ones_like(q_d), q_d)
    else:
        p_d = jnp.take_along_axis(draft_probs, draft_tokens[:, None], axis=-1)[:, 0]
        accept = u < acceptance_probability(p_d, q_d)
    accept &= jnp.arange(n) < limit
    accepted = jnp.cumprod(accept).astype(bool)
    num_accepted = jnp.sum(accepted).astype(jnp.int32)

    q_next = target_probs[num_accepted]
    rejected_a_draft = num_accepted < limit  # else every draft of the row passed: the bonus position
    if draft_probs is None:
        # residual(q, one_hot(d)) is q without d, renormalized; at the bonus position nothing is removed.
        rejected = jnp.where(rejected_a_draft, draft_tokens[jnp.minimum(num_accepted, n - 1)], -1)
        p_next = (jnp.arange(q_next.shape[0]) == rejected).astype(q_next.dtype)
    else:
        # A zero row stands for "no draft" at the bonus position: residual(q, 0) = q,
        # so the correction and the bonus token come from one code path.
        p_next = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:1])], axis=0)[num_accepted]
        p_next = jnp.where(rejected_a_draft, p_next, 0.0)
    next_token = sample(sample_key, residual_distribution(q_next, p_next))

    slots = jnp.arange(n + 1)
    drafts_padded = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    tokens = jnp.where(slots < num_accepted, drafts_padded, pad_id)
    tokens = jnp.where(slots == num_accepted, next_token, tokens).astype(jnp.int32)
    return ChainVerdict(tokens, num_accepted, num_accepted + 1, accepted)


def _probs_axis(draft_probs):
    return None if draft_probs is None else 0


_verify_chain_jit = jax.jit(_verify_chain)


def _batched(draft_probs, num_drafts):
    in_axes = (0, _probs_axis(draft_probs), 0, 0, None, None if num_drafts is None else 0)
    return jax.vmap(_verify_chain, in_axes=in_axes)


@jax.jit
def _verify_chain_batch_jit(draft_tokens, draft_probs, target_probs, keys, pad_id, num_drafts=None):
    return _batched(draft_probs, num_drafts)(draft_tokens, draft_probs, target_probs, keys, pad_id, num_drafts)


def _check_counts(num_drafts, shape, n: int) -> None:
    """num_drafts: int[shape] in 0..N (values checked when concrete)."""
    if num_drafts is None:
        return
    if tuple(np.shape(num_drafts)) != tuple(shape):
        raise ValueError(f"num_drafts must have shape {tuple(shape)} (one count per row); got {np.shape(num_drafts)}.")
    if is_concrete(num_drafts):
        counts = np.asarray(num_drafts)
        if counts.dtype.kind not in "iu" or (counts.size and (counts.min() < 0 or counts.max() > n)):
            raise ValueError(f"num_drafts must be whole numbers in 0..{n} (N); got {counts.tolist()}.")


def verify_chain(draft_tokens, draft_probs, target_probs, key, pad_id=0, num_drafts=None) -> ChainVerdict:
    """Accepts a prefix of N drafts for one sequence and emits the next token.

    Usable inside ``jit`` and ``vmap``; called on concrete arrays it validates
    them first and runs a compiled version (one compilation per N and V).

    Args:
      draft_tokens: int32[N], the drafts, N >= 1 (static).
      draft_probs: float32[N, V], the drafter's distribution at each draft
        position, or None for deterministic drafts (verified as one-hot rows).
      target_probs: float32[N + 1, V], the target's distribution at each draft
        position and at the bonus position.
      key: PRNG key.
      pad_id: value for unused slots of ``tokens``.
      num_drafts: int32[], how many of the N slots hold drafts (0..N; default N): the rest are
        never accepted, and when all of the first ``num_drafts`` pass the next token is the bonus
        drawn from ``target_probs[num_drafts]``. With 0 the step is a plain one: one token from
        ``target_probs[0]``.

    Returns:
      A :class:`ChainVerdict`.

    Raises:
      ValueError: mismatched shapes, N < 1, out-of-range tokens or counts, or rows that
        are not distributions.
    """
    validate_chain_inputs(draft_tokens, draft_probs, target_probs, batched=False)
    _check_counts(num_drafts, (), np.shape(draft_tokens)[-1])
    fn = _verify_chain if _any_traced(draft_tokens, draft_probs, target_probs, key, num_drafts) else _verify_chain_jit
    return fn(draft_tokens, draft_probs, target_probs, key, jnp.int32(pad_id), num_drafts)


def verify_chain_batch(draft_tokens, draft_probs, target_probs, keys, pad_id=0, num_drafts=None) -> ChainVerdict:
    """:func:`verify_chain` vmapped over a batch; every row is independent.

    Args:
      draft_tokens: int32[B, N].
      draft_probs: float32[B, N, V], or None for deterministic drafts.
      target_probs: float32[B, N + 1, V].
      keys: PRNG keys [B] (one per row, e.g. ``jax.random.split(key, B)``).
      pad_id: value for unused slots of ``tokens``.
      num_drafts: int32[B], drafts per row (0..N; default N in every row): rows draft different
        lengths, each verified exactly as a chain of its own length (see :func:`verify_chain`).

    Returns:
      A :class:`ChainVerdict` whose fields have a leading B axis.
    """
    validate_chain_inputs(draft_tokens, draft_probs, target_probs, batched=True)
    _check_counts(num_drafts, np.shape(draft_tokens)[:1], np.shape(draft_tokens)[-1])
    if np.shape(keys)[:1] != np.shape(draft_tokens)[:1]:
        raise ValueError(
            f"need one key per row: got keys of shape {np.shape(keys)} for batch "
            f"{np.shape(draft_tokens)[0]}; use jax.random.split(key, B)."
        )
    if _any_traced(draft_tokens, draft_probs, target_probs, keys, num_drafts):
        fn = _batched(draft_probs, num_drafts)
    else:
        fn = _verify_chain_batch_jit
    return fn(draft_tokens, draft_probs, target_probs, keys, jnp.int32(pad_id), num_drafts)


@jax.jit
def _verify_chain_batch_logits(draft_tokens, draft_logits, target_logits, keys, sampling, pad_id):
    p = None if draft_logits is None else probs_from_logits(draft_logits, sampling)
    return _verify_chain_batch_jit(draft_tokens, p, probs_from_logits(target_logits, sampling), keys, pad_id)


def _check_logits(draft_tokens, draft_logits, target_logits, *, batched: bool) -> None:
    """The shape checks of :func:`validate_chain_inputs` for logits (any real values are logits)."""
    lead = "[B, " if batched else "["
    d_shape, q_shape = np.shape(draft_tokens), np.shape(target_logits)
    if len(d_shape) != (2 if batched else 1) or d_shape[-1] < 1:
        raise ValueError(f"draft_tokens must be int {lead}N] with N >= 1; got shape {d_shape}.")
    n = d_shape[-1]
    if tuple(q_shape[:-1]) != (*d_shape[:-1], n + 1):
        raise ValueError(f"target_logits must be {lead}N + 1, V] for draft_tokens {d_shape}; got {q_shape}.")
    if draft_logits is not None and tuple(np.shape(draft_logits)) != (*d_shape, q_shape[-1]):
        raise ValueError(f"draft_logits must be {lead}N, V] = {(*d_shape, q_shape[-1])}; got {np.shape(draft_logits)}.")


def verify_chain_logits(draft_tokens, draft_logits, target_logits, key, sampling: SamplingParams | None = None,
                        pad_id=0) -> ChainVerdict:  # fmt: skip
    """:func:`verify_chain` on logits: both sides become distributions with ``sampling``
    (temperature, top-k, top-p; default temperature 1 with nothing cut) inside one compiled program.

    Args:
      draft_tokens: int32[N]; draft_logits: float32[N, V] or None (deterministic drafts);
      target_logits: float32[N + 1, V]; key: PRNG key.
    """
    _check_logits(draft_tokens, draft_logits, target_logits, batched=False)
    sampling = SamplingParams.create() if sampling is None else sampling
    verdict = _verify_chain_batch_logits(
        jnp.asarray(draft_tokens)[None], None if draft_logits is None else jnp.asarray(draft_logits)[None],
        jnp.asarray(target_logits)[None], jnp.asarray(key)[None], sampling, jnp.int32(pad_id),
    )  # fmt: skip
    return jax.tree.map(lambda x: x[0], verdict)


def verify_chain_batch_logits(draft_tokens, draft_logits, target_logits, keys, sampling: SamplingParams | None = None,
                              pad_id=0) -> ChainVerdict:  # fmt: skip
    """:func:`verify_chain_logits` for a batch: int32[B, N], [B, N, V] or None, [B, N + 1, V], keys [B];
    ``sampling``'s knobs broadcast against the logits' leading axes (scalars, or [B, 1] per row)."""
    _check_logits(draft_tokens, draft_logits, target_logits, batched=True)
    if np.shape(keys)[:1] != np.shape(draft_tokens)[:1]:
        raise ValueError(f"need one key per row: got keys of shape {np.shape(keys)}; use jax.random.split(key, B).")
    sampling = SamplingParams.create() if sampling is None else sampling
    return _verify_chain_batch_logits(draft_tokens, draft_logits, target_logits, keys, sampling, jnp.int32(pad_id))


def _any_traced(*xs) -> bool:
    return any(x is not None and not is_concrete(x) for x in xs)
