"""Toy distributions with a chosen acceptance rate, and simulated verify steps.

Used to check the speedup math against the real verifier: the tokens per
verify measured by running :func:`jspec.verify_chain_batch` must match
E(α, N), and the acceptance rate it shows must match E[Σ min(p, q)].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.sampling import sample
from jspec.speedup import expected_alpha, expected_tokens
from jspec.verify import verify_chain_batch

__all__ = ["SimulatedRun", "pair_with_overlap", "simulate_chain"]


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
    k_pairs, k_draft, k_verify = jax.random.split(key, 3)
    pairs = [pair_with_overlap(k, alpha, vocab) for k in jax.random.split(k_pairs, num_draft + 1)]
    p = jnp.stack([pp for pp, _ in pairs[:num_draft]])  # [N, V]
    q = jnp.stack([qq for _, qq in pairs])  # [N + 1, V]
    drafts = sample(k_draft, jnp.broadcast_to(p, (steps, num_draft, vocab)))
    verdict = verify_chain_batch(
        drafts,
        jnp.broadcast_to(p, (steps, num_draft, vocab)),
        jnp.broadcast_to(q, (steps, num_draft + 1, vocab)),
        jax.random.split(k_verify, steps),
    )
    accepted = np.asarray(verdict.num_accepted)
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
