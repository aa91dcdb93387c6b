"""When speculation pays: the adaptive loop's policy and the step costs it weighs.

The engine (:mod:`jspec.loop.engine`) asks :func:`worth_speculating` before each step of an adaptive
loop: each live row's running estimate of accepted drafts against what a speculative and a plain
step cost on this machine (:class:`StepCosts`, from the cost profile of :mod:`jspec.tune`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from jspec.loop.control import switch

__all__ = ["Adaptive", "StepCosts", "check_widths", "choose_width", "narrow_verify", "worth_speculating"]


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
      widths: narrower verify forwards (tokens: the pending one and w - 1 drafts) a chain may
        stop at, besides the full N + 1; each step takes the width whose expected tokens (from
        the drafter's confidence in each draft) per cost (``StepCosts.forward``) is highest.
        Each width is one more compiled forward (:func:`jspec.loop.control.switch`); () keeps the full width.
    """

    probe_every: int = 8
    max_probe_every: int = 64
    decay: float = 0.7
    prior: float | None = None
    widths: tuple[int, ...] = ()

    def __post_init__(self):
        if any(not isinstance(w, int) or w < 2 for w in self.widths) or list(self.widths) != sorted(set(self.widths)):
            raise ValueError(f"widths must be increasing whole numbers >= 2 (the pending token and at least one "
                             f"draft); got {self.widths}.")  # fmt: skip
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
      forward: float32[K + 1] or None: r(w), the verify forward at each of the policy's
        ``widths`` and at the full width (last), for an adaptive draft length.
    """

    speculative: jax.Array
    plain: jax.Array
    forward: jax.Array | None = None

    @classmethod
    def create(cls, speculative: float, plain: float = 1.0, forward=None) -> StepCosts:
        if not speculative > 0 or not plain > 0:
            raise ValueError(f"step costs must be > 0; got speculative {speculative}, plain {plain}.")
        if forward is not None:
            forward = [float(f) for f in forward]
            if not forward or min(forward) <= 0 or forward[-1] > speculative:
                raise ValueError(f"forward costs must be > 0, the last (the full width) within the speculative step "
                                 f"({speculative}); got {forward}.")  # fmt: skip
            forward = jnp.asarray(forward, jnp.float32)
        return cls(jnp.float32(speculative), jnp.float32(plain), forward)

    @classmethod
    def from_profile(cls, profile, drafter_name: str, width: int, widths: tuple[int, ...] = ()) -> StepCosts:
        """From a :class:`jspec.tune.CostProfile`: ``r(width)`` plus the drafter's propose and commit; a
        plain step plus the drafter's commit; with ``widths`` (an adaptive draft length), r(w) at each."""
        d = profile.drafters.get(drafter_name)
        if d is None:
            raise ValueError(f"the profile has no drafter {drafter_name!r}; it measured {sorted(profile.drafters)}.")
        forward = [profile.relative_forward(w) for w in (*widths, width)] if widths else None
        return cls.create(profile.relative_forward(width) + profile.relative_drafter(drafter_name),
                          1.0 + d["commit_ms"] / profile.step_ms, forward)  # fmt: skip


def worth_speculating(accepted_estimate, live, costs: StepCosts):
    """Tokens per unit of time: speculating emits 1 + the accepted drafts per live row for the cost of
    a speculative step, a plain step one token per live row for the cost of a plain step."""
    spec_rate = jnp.sum(jnp.where(live, 1.0 + accepted_estimate, 0.0)) / costs.speculative
    return spec_rate >= jnp.sum(live) / costs.plain


def choose_width(confidence, live, costs: StepCosts, widths: tuple[int, ...]):
    """The index into ``(*widths, N + 1)`` of the verify width with the most expected tokens per cost.

    A row verifying w - 1 drafts emits ``1 + sum_{i < w} prod_{j <= i} confidence_j`` tokens in
    expectation (the drafter's confidence as the chance each draft is accepted after the ones
    before); the step costs ``r(w)`` plus the drafter's propose and commit, paid whatever the width.

    Args:
      confidence: float32[B, N]; live: bool[B]; costs: with ``forward`` at every width.
      widths: the narrower widths (static), the full width N + 1 implied last.
    """
    n = confidence.shape[1]
    reach = jnp.cumprod(jnp.clip(confidence, 0.0, 1.0), axis=1)  # P(accepted >= i), i = 1..N
    accepted = jnp.concatenate([jnp.zeros_like(reach[:, :1]), jnp.cumsum(reach, axis=1)], axis=1)  # [B, N + 1]
    drafts = jnp.asarray([w - 1 for w in widths] + [n], jnp.int32)
    tokens = jnp.sum(jnp.where(live[:, None], 1.0 + accepted[:, drafts], 0.0), axis=0)  # [K + 1]
    drafter = costs.speculative - costs.forward[-1]
    return jnp.argmax(tokens / (costs.forward + drafter)).astype(jnp.int32)


def check_widths(drafter, widths: tuple[int, ...], costs: StepCosts) -> None:
    """An adaptive draft length needs a chain drafter without lookahead tokens, widths below its
    full N + 1, and the forward cost at each width and the full one."""
    if drafter.num_nodes is not None or drafter.num_lookahead:
        raise ValueError("an adaptive draft length (Adaptive(widths=...)) is for chain drafters; this one drafts "
                         "a tree or lookahead tokens.")  # fmt: skip
    if max(widths) > drafter.num_draft:
        raise ValueError(f"widths {widths} must stay below the full width N + 1 = {drafter.num_draft + 1} "
                         "(it is always a choice).")  # fmt: skip
    if costs.forward is None or costs.forward.shape != (len(widths) + 1,):
        raise ValueError(f"an adaptive draft length needs StepCosts.forward: r(w) at each of {widths} and at the "
                         f"full width (StepCosts.from_profile(..., widths={widths})).")  # fmt: skip


def _narrow_forward(target, w: int, full: int, hidden_layers, tokens, positions, cache):
    """The target over the first ``w`` of the step's ``full`` tokens (causal), its logits and hidden
    states padded back to ``full`` positions (never read: no draft past w - 1 is verified), so that
    every width of a switch returns the same shapes."""
    out = target(tokens[:, :w], positions[:, :w], cache, None, hidden_layers=hidden_layers)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, full - w)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    return dataclasses.replace(out, logits=pad(out.logits), hidden_states=tuple(pad(h) for h in out.hidden_states))


def narrow_verify(target, drafter, proposal, live, costs: StepCosts, widths, tokens, positions, cache, hidden_layers):
    """The verify forward of a chain at the width :func:`choose_width` picks (one compiled forward
    per width, :func:`jspec.loop.control.switch`), and each row's draft count cut to it.

    Returns:
      (the target's output over N + 1 positions, int32[B] drafts to verify per row).
    """
    if proposal.confidence is None:
        raise ValueError(f"{type(drafter).__name__} gives no confidence in its drafts; an adaptive draft length "
                         "(Adaptive(widths=...)) needs one (a draft model or an EAGLE head).")  # fmt: skip
    n = proposal.tokens.shape[1]
    pick = choose_width(proposal.confidence, live, costs, widths)
    forwards = [functools.partial(_narrow_forward, target, w, n + 1, hidden_layers) for w in (*widths, n + 1)]
    # jspec.loop.control.switch keeps the cache in place: the carry is an output of the full width's shapes
    # (zeros, never read: one width always runs) holding the cache each width writes into.
    shapes = jax.eval_shape(forwards[-1], tokens, positions, cache)
    empty = dataclasses.replace(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), cache=cache)
    branches = [lambda out, f=f: f(tokens, positions, out.cache) for f in forwards]
    out = switch(pick, branches, empty)
    verified = jnp.asarray([w - 1 for w in widths] + [n], jnp.int32)[pick]
    counts = jnp.full((live.shape[0],), n, jnp.int32) if proposal.num_drafts is None else proposal.num_drafts
    return out, jnp.minimum(counts, verified)
