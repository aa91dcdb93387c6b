"""Speedup math for chain speculative decoding.

With per-position acceptance rate α and N drafts per step, the tokens emitted
per target forward (the bonus token counted) are

    E(α, N) = (1 - α^(N+1)) / (1 - α),        E(1, N) = N + 1.

One step costs one target forward over N + 1 tokens plus N drafter steps. With
a one-token target step as the unit, ``c`` the cost of one drafter step and
``r`` the cost of the (N + 1)-token verify forward,

    time per token = (r + N c) / E,           speedup = E / (r + N c).

The classic formula takes r = 1, which holds on accelerators where a forward
over a few more tokens is nearly free; on a CPU r grows with N and must be
measured. ``verify_cost`` may be one number or a function of N.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

__all__ = [
    "SpeedupEstimate",
    "best_num_draft",
    "estimate",
    "expected_alpha",
    "expected_tokens",
    "expected_tokens_from_rates",
    "linear_verify_cost",
    "speedup",
    "time_per_token",
]

VerifyCost = float | Callable[[int], float]


def _check_alpha_c(alpha: float, cost_ratio: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha (acceptance rate) must lie in [0, 1]; got {alpha}.")
    if not cost_ratio >= 0.0:
        raise ValueError(f"cost ratio c (drafter step / target step) must be >= 0; got {cost_ratio}.")


def _check_n(num_draft: int) -> None:
    if int(num_draft) != num_draft or num_draft < 1:
        raise ValueError(f"the number of drafts N must be a whole number >= 1; got {num_draft}.")


def _verify_cost(verify_cost: VerifyCost, num_draft: int) -> float:
    r = verify_cost(num_draft) if callable(verify_cost) else verify_cost
    if not r > 0:
        raise ValueError(f"verify cost r must be > 0 (1 = a one-token step); got {r} at N = {num_draft}.")
    return float(r)


def linear_verify_cost(base: float = 1.0, slope: float = 0.0) -> Callable[[int], float]:
    """r(N) = base + slope * N: a verify forward whose cost grows with its tokens.

    On accelerators slope is about 0; on a 2-core CPU a six-token forward cost
    about 2.5 one-token steps (base 1, slope 0.3). Fit both from measurements.
    """
    if not base > 0 or slope < 0:
        raise ValueError(f"verify cost needs base > 0 and slope >= 0; got base {base}, slope {slope}.")

    def cost(num_draft: int) -> float:
        return base + slope * num_draft

    cost.label = f"{base:g} + {slope:g} N" if slope else f"{base:g}"
    return cost


def expected_tokens(alpha: float, num_draft: int) -> float:
    """E(α, N): expected tokens per target forward, bonus token included."""
    _check_alpha_c(alpha, 0.0)
    _check_n(num_draft)
    if alpha == 1.0:
        return float(num_draft + 1)
    # expm1/log1p keep E accurate for α within 1e-12 of 1, where 1 - α^(N+1) cancels.
    return -math.expm1((num_draft + 1) * math.log(alpha)) / (1.0 - alpha) if alpha > 0 else 1.0


def time_per_token(alpha: float, num_draft: int, cost_ratio: float, verify_cost: VerifyCost = 1.0) -> float:
    """(r + N c) / E, relative to one plain decoding step per token."""
    _check_alpha_c(alpha, cost_ratio)
    r = _verify_cost(verify_cost, num_draft)
    return (r + num_draft * cost_ratio) / expected_tokens(alpha, num_draft)


def speedup(alpha: float, num_draft: int, cost_ratio: float, verify_cost: VerifyCost = 1.0) -> float:
    """E / (r + N c): wall-clock speedup over plain decoding."""
    return 1.0 / time_per_token(alpha, num_draft, cost_ratio, verify_cost)


@dataclasses.dataclass(frozen=True)
class SpeedupEstimate:
    alpha: float
    cost_ratio: float
    num_draft: int
    verify_cost: float
    expected_tokens: float
    time_per_token: float
    speedup: float

    @property
    def worthwhile(self) -> bool:
        """Whether speculation beats plain decoding at all."""
        return self.speedup > 1.0


def estimate(alpha: float, num_draft: int, cost_ratio: float, verify_cost: VerifyCost = 1.0) -> SpeedupEstimate:
    """All figures for one (α, N, c, r)."""
    r = _verify_cost(verify_cost, num_draft)
    tpt = time_per_token(alpha, num_draft, cost_ratio, r)
    return SpeedupEstimate(
        alpha=alpha,
        cost_ratio=cost_ratio,
        num_draft=int(num_draft),
        verify_cost=r,
        expected_tokens=expected_tokens(alpha, num_draft),
        time_per_token=tpt,
        speedup=1.0 / tpt,
    )


def best_num_draft(
    alpha: float, cost_ratio: float, verify_cost: VerifyCost = 1.0, max_draft: int = 64
) -> SpeedupEstimate:
    """The N in 1..max_draft with the highest speedup (the smallest N on ties)."""
    _check_alpha_c(alpha, cost_ratio)
    _check_n(max_draft)
    best = None
    for n in range(1, max_draft + 1):
        est = estimate(alpha, n, cost_ratio, verify_cost)
        if best is None or est.speedup > best.speedup * (1 + 1e-12):
            best = est
    return best


def expected_alpha(draft_probs, target_probs) -> float:
    """α = E[Σ_x min(p(x), q(x))]: the acceptance rate one draft position has.

    Args:
      draft_probs: float[..., V], the drafter's distributions p.
      target_probs: float[..., V], the target's distributions q at the same
        positions; the mean is taken over all leading axes.
    """
    p = np.asarray(draft_probs, np.float64)
    q = np.asarray(target_probs, np.float64)
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape; got {p.shape} and {q.shape}.")
    return float(np.minimum(p, q).sum(-1).mean())


def expected_tokens_from_rates(alphas) -> float:
    """E when each draft position i has its own acceptance rate α_i.

    E = Σ_{k=0..N} Π_{i<k} α_i: position k is emitted when drafts 0..k-1 were
    all accepted. Equal rates give :func:`expected_tokens`.
    """
    rates = np.asarray(alphas, np.float64)
    if rates.ndim != 1 or rates.size < 1:
        raise ValueError(f"alphas must be a 1-D list of per-position rates; got shape {rates.shape}.")
    return float(1.0 + np.cumprod(rates).sum())
