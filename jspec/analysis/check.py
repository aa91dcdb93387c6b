"""The Leviathan exactness check: speculative sampling against direct sampling.

Fixed draft distributions p_0..p_{N-1} and target distributions q_0..q_N (one
per position, independent of the context) are run through a chain verifier
for many steps. Conditional on a step emitting a token at position j, that
token must be a draw from q_j, whatever happened before it. For every emitted
position j the counts are compared with as many direct draws from q_j in a
2 x V Pearson chi-square test; the statistics of all positions are summed
(given the positions before it, each position's test is independent of them)
and compared with the critical value for the summed degrees of freedom.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.analysis.simulate import Verifier, simulate_steps
from jspec.analysis.speedup import expected_alpha, expected_tokens_from_rates
from jspec.core.sampling import sample
from jspec.core.verify import verify_chain

__all__ = [
    "CheckConfig",
    "CheckResult",
    "make_distributions",
    "run_check",
    "two_sample_chi2",
    "verify_chain_without_residual",
]

_MIN_EXPECTED = 5.0  # Pearson's rule of thumb; rarer tokens are pooled into one bin.


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    """Knobs of the check.

    Attributes:
      steps: speculative steps, and direct draws per position.
      num_draft: N, drafts per step.
      vocab: V.
      seed: fixes the distributions and all draws.
      distance: how far p is from q, in [0, 1]: p = (1 - d) q + d r with r an
        unrelated sparse distribution; 0 makes p = q (every draft accepted).
      level: significance level of the test (0.05 gives the 95% critical value).
    """

    steps: int = 50_000
    num_draft: int = 4
    vocab: int = 16
    seed: int = 0
    distance: float = 0.5
    level: float = 0.05

    def __post_init__(self):
        if self.steps < 100:
            raise ValueError(f"steps must be at least 100 for a meaningful test; got {self.steps}.")
        if self.num_draft < 1:
            raise ValueError(f"num_draft (N) must be >= 1; got {self.num_draft}.")
        if self.vocab < 2:
            raise ValueError(f"vocab must be >= 2; got {self.vocab}.")
        if not 0.0 <= self.distance <= 1.0:
            raise ValueError(f"distance must lie in [0, 1]; got {self.distance}.")
        if not 0.0 < self.level < 1.0:
            raise ValueError(f"level must lie in (0, 1); got {self.level}.")


@dataclasses.dataclass(frozen=True)
class CheckResult:
    chi2: float
    critical: float
    dof: int
    p_value: float
    passed: bool
    acceptance_rate: float
    expected_acceptance_rate: float
    tokens_per_step: float
    expected_tokens_per_step: float
    impossible_tokens: int
    per_position: list[dict]
    config: CheckConfig

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(out.pop("config"))
        return out


def make_distributions(key: jax.Array, num_draft: int, vocab: int, distance: float):
    """Draft and target distributions with zeros in both, p at ``distance`` from q.

    Returns:
      (p float32[N, V], q float32[N + 1, V]).
    """
    kq, kz, kr, krz = jax.random.split(key, 4)
    q = jax.nn.softmax(1.5 * jax.random.normal(kq, (num_draft + 1, vocab)), axis=-1)
    # Zero a quarter of q's entries (never a whole row) so p(d) > 0 = q(d) occurs.
    q_zero = jax.random.uniform(kz, q.shape) < 0.25
    q_zero = q_zero.at[:, 0].set(False)
    q = jnp.where(q_zero, 0.0, q)
    q = q / q.sum(-1, keepdims=True)
    r = jax.nn.softmax(jax.random.normal(kr, (num_draft, vocab)), axis=-1)
    r_zero = jax.random.uniform(krz, r.shape) < 0.5
    r_zero = r_zero.at[:, 1].set(False)
    r = jnp.where(r_zero, 0.0, r)
    r = r / r.sum(-1, keepdims=True)
    p = (1.0 - distance) * q[:num_draft] + distance * r
    return p, q


def verify_chain_without_residual(draft_tokens, draft_probs, target_probs, key, pad_id=0, num_drafts=None):
    """A deliberately wrong verifier for negative controls.

    It corrects a rejection with a draw from q instead of the residual
    (q - p)+, which over-produces tokens the drafter favours. The check must
    reject it.
    """
    del pad_id
    n = draft_tokens.shape[0]
    verdict = verify_chain(draft_tokens, draft_probs, target_probs, key, num_drafts=num_drafts)
    k = verdict.num_accepted
    redraw = sample(jax.random.fold_in(key, 7), target_probs[k])
    rejected = k < (n if num_drafts is None else num_drafts)
    tokens = jnp.where(rejected & (jnp.arange(n + 1) == k), redraw, verdict.tokens).astype(jnp.int32)
    return dataclasses.replace(verdict, tokens=tokens)


def two_sample_chi2(counts_a: np.ndarray, counts_b: np.ndarray) -> tuple[float, int]:
    """Pearson chi-square of a 2 x V contingency table.

    Tokens whose expected count is below 5 in either row are pooled into one
    bin; tokens never seen are dropped. Returns (statistic, degrees of freedom).
    """
    a = np.asarray(counts_a, np.float64)
    b = np.asarray(counts_b, np.float64)
    na, nb = a.sum(), b.sum()
    if na == 0 or nb == 0:
        return 0.0, 0
    total = a + b
    small = np.minimum(total * na, total * nb) / (na + nb) < _MIN_EXPECTED
    bins_a = np.append(a[~small], a[small].sum())
    bins_b = np.append(b[~small], b[small].sum())
    keep = (bins_a + bins_b) > 0
    bins_a, bins_b = bins_a[keep], bins_b[keep]
    if bins_a.size < 2:
        return 0.0, 0
    table = np.stack([bins_a, bins_b])
    expected = table.sum(0, keepdims=True) * table.sum(1, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), int(bins_a.size - 1)


def run_check(config: CheckConfig = CheckConfig(), verifier: Verifier = verify_chain) -> CheckResult:
    """Runs the exactness check; ``verifier`` follows :func:`jspec.verify_chain`."""
    key = jax.random.PRNGKey(config.seed)
    k_dist, k_spec, k_direct = jax.random.split(key, 3)
    p, q = make_distributions(k_dist, config.num_draft, config.vocab, config.distance)
    tokens, num_accepted = simulate_steps(verifier, p, q, k_spec, config.steps)
    q_np = np.asarray(q, np.float64)
    n, vocab = config.num_draft, config.vocab

    direct = np.asarray(
        sample(k_direct, jnp.broadcast_to(q, (config.steps, n + 1, vocab)))
    )  # [steps, N + 1]: direct draws from each q_j
    chi2_total, dof_total, impossible, per_position = 0.0, 0, 0, []
    for j in range(n + 1):
        emitted = tokens[num_accepted >= j, j]
        spec_counts = np.bincount(emitted, minlength=vocab)
        direct_counts = np.bincount(direct[:, j], minlength=vocab)
        bad = int(spec_counts[q_np[j] == 0].sum())
        chi2, dof = two_sample_chi2(spec_counts, direct_counts)
        chi2_total += chi2
        dof_total += dof
        impossible += bad
        per_position.append(
            {"position": j, "emitted": int(emitted.size), "chi2": chi2, "dof": dof, "impossible_tokens": bad}
        )

    alphas = [expected_alpha(p[i], q[i]) for i in range(n)]
    for i in range(n):
        reached = int((num_accepted >= i).sum())
        per_position[i]["acceptance_rate"] = float((num_accepted > i).sum() / max(reached, 1))
        per_position[i]["expected_acceptance_rate"] = alphas[i]

    from scipy import stats  # imported here: scipy.stats adds seconds to `jspec` start-up; only this test needs it

    dof_total = max(dof_total, 1)
    critical = float(stats.chi2.ppf(1.0 - config.level, dof_total))
    p_value = float(stats.chi2.sf(chi2_total, dof_total))
    attempted = np.minimum(num_accepted + 1, n).sum()
    return CheckResult(
        chi2=chi2_total,
        critical=critical,
        dof=dof_total,
        p_value=p_value,
        passed=bool(chi2_total <= critical and impossible == 0),
        acceptance_rate=float(num_accepted.sum() / attempted),
        expected_acceptance_rate=float(np.mean(alphas)),
        tokens_per_step=float(np.mean(num_accepted + 1)),
        expected_tokens_per_step=expected_tokens_from_rates(alphas),
        impossible_tokens=impossible,
        per_position=per_position,
        config=config,
    )
