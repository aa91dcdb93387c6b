"""Toy verify steps: fixed draft and target distributions per position, many speculative steps.

:func:`simulate_steps` is the one toy simulation: drafts drawn from p_i, verified
against q_i by a chain verifier, chunk by chunk. The exactness check
(:mod:`jspec.analysis.check`) compares what it emits with direct draws; :func:`simulate_chain`
checks the speedup math with it: the tokens per verify must match E(α, N), and
the acceptance rate must match E[Σ min(p, q)].
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jspec.analysis.speedup import expected_alpha, expected_tokens
from jspec.core.sampling import sample
from jspec.core.verify import ChainVerdict, verify_chain

__all__ = ["SimulatedRun", "pair_with_overlap", "simulate_chain", "simulate_steps"]

Verifier = Callable[..., ChainVerdict]
_CHUNK = 8192


@functools.partial(jax.jit, static_argnums=0)
def _chunk(verifier: Verifier, p, q, chunk_key):
    """_CHUNK speculative steps (module level: one compilation per verifier and shape)."""

    def one(step_key):
        k_draft, k_verify = jax.random.split(step_key)
        drafts = sample(k_draft, p)  # d_i ~ p_i, independent per position
        verdict = verifier(drafts, p, q, k_verify)
        return verdict.tokens, verdict.num_accepted

    return jax.vmap(one)(jax.random.split(chunk_key, _CHUNK))


def simulate_steps(verifier: Verifier, p, q, key, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` speculative steps with drafts d_i ~ p_i [N, V] verified against q [N + 1, V] by
    ``verifier`` (:func:`jspec.verify_chain`'s signature); returns tokens [steps, N + 1] and the
    accepted counts [steps]."""
    tokens, accepted = [], []
    for i in range(-(-steps // _CHUNK)):
        t, a = _chunk(verifier, p, q, jax.random.fold_in(key, i))
        tokens.append(np.asarray(t))
        accepted.append(np.asarray(a))
    return np.concatenate(tokens)[:steps], np.concatenate(accepted)[:steps]


def pair_with_overlap(key: jax.Array, alpha: float, vocab: int):
    """(p, q) over V tokens with Σ_x min(p(x), q(x)) = alpha exactly.

    q = α s + (1 - α) a and p = α s + (1 - α) b, where a and b live on disjoint
    halves of the vocabulary, so min(p, q) = α s everywhere.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1]; got {alpha}.")
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2; got {vocab}.")
    ks, ka, kb = jax.random.split(key, 3)
    half = vocab // 2
    s = jax.nn.softmax(jax.random.normal(ks, (vocab,)))
    a = jax.nn.softmax(jax.random.normal(ka, (vocab,)) + jnp.where(jnp.arange(vocab) < half, 0.0, -jnp.inf))
    b = jax.nn.softmax(jax.random.normal(kb, (vocab,)) + jnp.where(jnp.arange(vocab) < half, -jnp.inf, 0.0))
    return alpha * s + (1 - alpha) * b, alpha * s + (1 - alpha) * a


@dataclasses.dataclass(frozen=True)
class SimulatedRun:
    alpha: float
    num_draft: int
    steps: int
    alpha_from_pq: float
    measured_alpha: float
    expected_tokens: float
    measured_tokens: float
    measured_tokens_stderr: float


def simulate_chain(alpha: float, num_draft: int, steps: int = 20_000, vocab: int = 32, seed: int = 0):
    """Runs ``steps`` verify steps in which every draft position has overlap α."""
    key = jax.random.PRNGKey(seed)
    k_pairs, k_verify = jax.random.split(key)
    pairs = [pair_with_overlap(k, alpha, vocab) for k in jax.random.split(k_pairs, num_draft + 1)]
    p = jnp.stack([pp for pp, _ in pairs[:num_draft]])  # [N, V]
    q = jnp.stack([qq for _, qq in pairs])  # [N + 1, V]
    _, accepted = simulate_steps(verify_chain, p, q, k_verify, steps)
    attempted = np.minimum(accepted + 1, num_draft).sum()
    return SimulatedRun(
        alpha=alpha,
        num_draft=num_draft,
        steps=steps,
        alpha_from_pq=expected_alpha(p, q[:num_draft]),
        measured_alpha=float(accepted.sum() / attempted),
        expected_tokens=expected_tokens(alpha, num_draft),
        measured_tokens=float(np.mean(accepted + 1)),
        measured_tokens_stderr=float(np.std(accepted) / np.sqrt(steps)),
    )
