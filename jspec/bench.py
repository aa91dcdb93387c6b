"""Running a decoder over a prompt set, and what the measured costs predict.

Shared by ``jspec bench`` and the benchmark scripts in ``experiments/``: one
function aggregates a method's runs over prompts (compilation timed apart),
one predicts a speculative run's wall time from the costs measured alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jspec.decode import bucket
from jspec.engine import acceptance_by_position

__all__ = ["predicted_seconds", "run_prompts"]


def run_prompts(
    decoder, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, sampling, seed: int = 0, warmup: bool = True
) -> dict:
    """Generates for each prompt alone (batch 1) and sums what the runs measured.

    Args:
      decoder: a :class:`jspec.decode.Decoder` or :class:`jspec.engine.SpeculativeDecoder`.
      prompt_ids: token ids per prompt.
      warmup: first run each compiled loop once, untimed.

    Returns:
      A dict with ``new_tokens``, ``seconds`` (the loops alone), ``compile_seconds``,
      ``target_calls``, ``tokens_per_s``, ``tau`` (1.0 for plain decoding) and, for
      speculative decoders, ``verify_steps``, ``plain_steps`` and ``acceptance_by_position``.
    """
    totals = {"new_tokens": 0, "seconds": 0.0, "compile_seconds": 0.0, "target_calls": 0}
    spec = {"verify_steps": 0, "plain_steps": 0, "emitted_in_verify": 0, "live_row_steps": 0}
    hist = None
    if warmup:
        # The first run of a freshly compiled loop is slower (0.3-0.5 s more for SmolLM2 here):
        # run each length bucket once, untimed, with a budget in the same bucket.
        warm_budget = min(max_new_tokens, bucket(max_new_tokens) // 2 + 1)
        for _, prompt in sorted({bucket(len(p)): p for p in prompt_ids}.items()):
            r = decoder.generate([list(prompt)], warm_budget, sampling, seed=seed)
            totals["compile_seconds"] += r.compile_seconds
    for i, prompt in enumerate(prompt_ids):
        r = decoder.generate([list(prompt)], max_new_tokens, sampling, seed=seed + i)
        for key in totals:
            totals[key] += getattr(r, key)
        if hasattr(r, "accept_hist"):
            for key in spec:
                spec[key] += getattr(r, key)
            hist = np.asarray(r.accept_hist) if hist is None else hist + np.asarray(r.accept_hist)
    entry = totals | {"tokens_per_s": totals["new_tokens"] / totals["seconds"] if totals["seconds"] else 0.0}
    if hist is None:
        return entry | {"tau": 1.0}
    tau = spec["emitted_in_verify"] / spec["live_row_steps"] if spec["live_row_steps"] else 0.0
    return entry | spec | {"tau": tau, "acceptance_by_position": acceptance_by_position(hist)}


def predicted_seconds(
    entry: Mapping,
    step_seconds: float,
    prefill_seconds: float,
    relative_cost: Mapping[int, float],
    draft_units: float,
    plain_units: float = 0.0,
    prefill_units: float = 0.0,
) -> float:
    """Wall time a speculative run should take if the engine added nothing to the measured costs.

    Args:
      entry: the run's counts (``verify_steps``, ``plain_steps``) from :func:`run_prompts`;
        the number of draft tokens is ``len(entry["acceptance_by_position"])``.
      step_seconds: one plain decoding step of the target (measured in its loop).
      prefill_seconds: the target's prefills over the same prompts.
      relative_cost: r(k), a k-token target forward over a one-token one.
      draft_units: the drafter's cost per verify step, in target steps
        (a draft model: c (r_d(2) + N - 1), a catch-up forward then N - 1 steps).
      plain_units: the drafter's cost in a step where it found nothing (prompt lookup's search).
      prefill_units: the drafter's prefill over the target's.
    """
    n = len(entry["acceptance_by_position"])
    verify = entry["verify_steps"] * (relative_cost[n + 1] + draft_units)
    plain = entry["plain_steps"] * (1.0 + plain_units)
    return prefill_seconds * (1.0 + prefill_units) + step_seconds * (verify + plain)
