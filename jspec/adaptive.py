"""When speculation pays: the adaptive loop's policy and the step costs it weighs.

The engine (:mod:`jspec.engine`) asks :func:`worth_speculating` before each step of an adaptive
loop: each live row's running estimate of accepted drafts against what a speculative and a plain
step cost on this machine (:class:`StepCosts`, from the cost profile of :mod:`jspec.tune`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["Adaptive", "StepCosts", "worth_speculating"]


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Fall back to plain steps where speculation does not pay (static knobs of the loop).

    Attributes:
      probe_every: after this many fallback steps in a row, speculate once to measure again.
      max_probe_every: a probe that still finds speculation not worth it doubles the wait before
        the next one, up to this many steps (a probe costs a whole speculative step); a probe
        that finds it worth it resets the wait to ``probe_every``.
      decay: the weight of the old estimate in each row's running mean of accepted drafts.
      prior: the estimate a row starts from (drafts accepted per verify step); None starts at
        N, so a request speculates until it has measured otherwise.
    """

    probe_every: int = 8
    max_probe_every: int = 64
    decay: float = 0.7
    prior: float | None = None

    def __post_init__(self):
        if self.probe_every < 1 or not 0.0 <= self.decay < 1.0:
            raise ValueError(f"need probe_every >= 1 and 0 <= decay < 1; got {self.probe_every}, {self.decay}.")
        if self.max_probe_every < self.probe_every:
            raise ValueError(f"max_probe_every ({self.max_probe_every}) must be >= probe_every ({self.probe_every}).")
        if self.prior is not None and self.prior < 0:
            raise ValueError(f"prior (drafts accepted per step) must be >= 0; got {self.prior}.")


@struct.dataclass
class StepCosts:
    """What one step costs, in plain one-token steps (arrays: changing them does not recompile).

    Attributes:
      speculative: float32[], a verify forward over the drafter's width and the drafter's propose
        and commit (``r(W) + c``).
      plain: float32[], a plain step with the drafter's commit (1 + what the drafter does to keep up).
    """

    speculative: jax.Array
    plain: jax.Array

    @classmethod
    def create(cls, speculative: float, plain: float = 1.0) -> StepCosts:
        if not speculative > 0 or not plain > 0:
            raise ValueError(f"step costs must be > 0; got speculative {speculative}, plain {plain}.")
        return cls(jnp.float32(speculative), jnp.float32(plain))

    @classmethod
    def from_profile(cls, profile, drafter_name: str, width: int) -> StepCosts:
        """From a :class:`jspec.tune.CostProfile`: ``r(width)`` plus the drafter's propose and commit; a
        plain step plus the drafter's commit."""
        d = profile.drafters.get(drafter_name)
        if d is None:
            raise ValueError(f"the profile has no drafter {drafter_name!r}; it measured {sorted(profile.drafters)}.")
        return cls.create(profile.relative_forward(width) + profile.relative_drafter(drafter_name),
                          1.0 + d["commit_ms"] / profile.step_ms)  # fmt: skip


def worth_speculating(accepted_estimate, live, costs: StepCosts):
    """Tokens per unit of time: speculating emits 1 + the accepted drafts per live row for the cost of
    a speculative step, a plain step one token per live row for the cost of a plain step."""
    spec_rate = jnp.sum(jnp.where(live, 1.0 + accepted_estimate, 0.0)) / costs.speculative
    return spec_rate >= jnp.sum(live) / costs.plain
