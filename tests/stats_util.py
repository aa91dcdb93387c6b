"""Shared statistics helpers for the tests. The level is set once here."""

import numpy as np
from scipy import stats

# One significance level for every goodness-of-fit test. Seeds are fixed, so a
# test is deterministic; the level only decides how far a broken sampler must
# drift to be caught, and the negative controls show it is caught.
LEVEL = 1e-3


def gof_p_value(counts, probs) -> float:
    """Pearson goodness of fit of observed counts against known probabilities.

    Tokens with expected count below 5 are pooled; a count on a zero-probability
    token gives p = 0.
    """
    counts = np.asarray(counts, np.float64)
    probs = np.asarray(probs, np.float64)
    if np.any(counts[probs == 0] > 0):
        return 0.0
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if obs.size < 2:
        return 1.0
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    return float(stats.chi2.sf(chi2, obs.size - 1))


def sampled_p_value(spec, plain, vocab: int, positions=(1, 2, 3)) -> float:
    """Two-sample chi-square p-value of speculative against plain samples (int [rows, T] each), the
    positions' statistics summed."""
    from jspec.analysis.check import two_sample_chi2

    chi2, dof = 0.0, 0
    for j in positions:
        c, d = two_sample_chi2(np.bincount(spec[:, j], minlength=vocab), np.bincount(plain[:, j], minlength=vocab))
        chi2, dof = chi2 + c, dof + d
    return float(stats.chi2.sf(chi2, dof))
