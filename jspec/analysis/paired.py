"""Speedups of paired runs: each decoder's seconds per prompt, measured taking turns
(:func:`jspec.analysis.bench.run_interleaved`), compared prompt by prompt at matched answer lengths,
with a confidence interval over the prompts.

Shared by the tuner (``jspec tune``), ``jspec bench`` and the benchmark scripts in
``experiments/``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["matched_seconds", "speedup", "speedup_interval"]


def matched_seconds(entry: Mapping, plain: Mapping, end: str | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """Each batch's seconds for ``entry`` and ``plain`` (two ``run_interleaved`` entries over the same
    batches) as if both had generated the same number of tokens: what a paired speedup compares.

    Sampled decoders answer a prompt at different lengths (each samples its own tokens; exactness makes the
    lengths' distribution the same, not the lengths), and where a prompt's prefill is a large part of
    the time a ratio of rates then measures mostly how long the answers were (docs/log, 2026-12-07, RAG
    T = 1). Per batch i, ``seconds = prefill_i + cost_d * tokens`` for both decoders, ``entry`` with an
    extra fixed time of its own (a draft model's prefill); the difference of the two runs, fitted by
    least squares over the batches, gives each decoder's cost per token, and each run is moved along its
    cost to the batch's common length, the mean of the two. Where one cost cannot be told apart from the
    fixed times (one decoder always ran to the same length), the other is moved to its length.

    The fit keeps every time physical: no fixed time or cost below 0, and no cost above a run's own
    seconds per token (its prefill is not negative). A cost told apart by one or two prompts alone is
    noisy: fitted freely, plain decoding's cost came out below 0 where it stopped early on one prompt
    of 24, and the cell had no interval (docs/log, 2026-12-07, SmolLM2 HumanEval T = 1).
    Batches of equal lengths are left as measured (greedy decoding: always). A batch of several rows
    counts its rows' tokens together: there the time follows its longest row, and the fit is rougher.

    Where neither cost is told apart but the two together are (both decoders ended early on the same
    single prompt, the others at the cap), every pair of costs along a segment fits alike within the
    bounds: ``end`` picks the segment's end with the entry's cost lowest ("low") or highest ("high"),
    its middle by default; :func:`speedup_interval` takes both ends and spans them. Where each decoder
    always ran to one length of its own, only the bounds hold the costs, and the ends are the two
    corners with both costs lowest and both highest (:func:`_costs_at_one_length_each`).

    Returns:
      (entry's seconds, plain's seconds) at matched lengths; None where a moved time would not be above
      0 (a made-up run's).
    """
    if end not in (None, "low", "high"):
        raise ValueError(f"end is 'low', 'high' or None (the middle); got {end!r}.")
    tokens, seconds = np.asarray(entry["batch_tokens"], float), np.asarray(entry["batch_seconds"], float)
    p_tokens, p_seconds = np.asarray(plain["batch_tokens"], float), np.asarray(plain["batch_seconds"], float)
    if tokens.shape != p_tokens.shape or tokens.size == 0:
        raise ValueError(f"a paired speedup needs runs over the same batches; got {tokens.size} and {p_tokens.size}.")
    if np.array_equal(tokens, p_tokens):
        return seconds, p_seconds
    design = np.column_stack([np.ones_like(tokens), tokens, -p_tokens])
    # A cost is told apart from the fixed times where its unit vector lies in the design's row space.
    known = np.isclose(np.linalg.pinv(design) @ design, np.eye(3), atol=1e-6).all(axis=0)[1:]
    segment = not known.any()  # neither cost told apart: a segment of costs, if the two together are (rank 2)
    # (Above 0 for the solver, where a made-up run has a time at or below 0: its cost is then held at 0.)
    top = [max(float(np.min(s[n > 0] / n[n > 0])), 1e-12) for s, n in ((seconds, tokens), (p_seconds, p_tokens))]
    if segment and np.linalg.matrix_rank(design) == 1:  # each decoder always at one length of its own
        cost, p_cost = _costs_at_one_length_each(seconds - p_seconds, tokens[0], p_tokens[0], top, end)
    else:
        cost, p_cost = _fitted_costs(design, seconds - p_seconds, known, top, end)
    common = (tokens + p_tokens) / 2 if known.all() or segment else (p_tokens if known[0] else tokens)
    moved, p_moved = seconds + cost * (common - tokens), p_seconds + p_cost * (common - p_tokens)
    return (moved, p_moved) if (moved > 0).all() and (p_moved > 0).all() else None


def _fitted_costs(design: np.ndarray, difference: np.ndarray, known: np.ndarray, top: Sequence[float],
                  end: str | None) -> tuple[float, float]:  # fmt: skip
    """The costs per token (entry's, plain's) for :func:`matched_seconds`: ``difference`` fitted on
    ``design`` by bounded least squares; a cost not ``known`` (told apart) stays 0, merged with the
    fixed time. Where neither is known, the fit is one point of a segment, moved to the ``end`` asked."""
    from scipy.optimize import lsq_linear  # here, as scipy.stats below: only sampled pairs need it

    segment = not known.any()
    # The first column is the entry's own fixed time; where a cost is not told apart, it merges with
    # it: f + cost * T for the entry's (from 0 up), f - cost * T for plain's (from -top * T up).
    low = 0.0 if known[1] or segment else top[1] * float(design[0, 2])  # plain at one length: -design[0, 2]
    columns = [0] + [1 + i for i in range(2) if known[i] or segment]
    bounds = np.array([[low, np.inf]] + [[0.0, top[i - 1]] for i in columns[1:]]).T
    fit = lsq_linear(design[:, columns], difference, bounds=tuple(bounds), method="bvls").x
    if segment:  # the fit is one point of a segment of costs that fit alike: go to the end asked
        direction = np.linalg.svd(design)[2][-1]  # the design's null space: one dimension (rank 2)
        direction = direction if direction[1] > 0 or (direction[1] == 0 and direction[2] >= 0) else -direction
        moving = np.abs(direction) > 1e-12
        steps = (bounds[:, moving] - fit[moving]) / direction[moving]
        lowest, highest = float(np.max(steps.min(axis=0))), float(np.min(steps.max(axis=0)))
        fit = fit + direction * {"low": lowest, "high": highest, None: (lowest + highest) / 2}[end]
    costs = dict(zip(columns[1:], fit[1:], strict=True))
    return costs.get(1, 0.0), costs.get(2, 0.0)


def _costs_at_one_length_each(difference: np.ndarray, length: float, p_length: float, top: Sequence[float],
                              end: str | None) -> tuple[float, float]:  # fmt: skip
    """The costs per token (entry's, plain's) for :func:`matched_seconds` where each decoder always ran to
    one length of its own: only ``f + cost * length - p_cost * p_length``, the mean ``difference``, is
    fitted, and every pair of costs in the bounds with ``f`` not below 0 fits alike. Moved to the mean
    length, the shorter run's seconds rise with its cost and the longer's fall with its own, so either
    cost moves the speedup the same way: it is extreme where both costs are lowest ("low") or both
    highest ("high"), each as far as the other lets it. The middle between the two by default."""
    # The difference as fitted within the bounds: f >= 0, p_cost <= top[1] (below that, no pair fits it).
    fitted = max(float(difference.mean()), -top[1] * p_length)
    lowest = (0.0, max(0.0, -fitted / p_length))  # the entry's cost at 0; plain's just high enough for f >= 0
    highest = (min(top[0], (fitted + top[1] * p_length) / length), top[1])
    middle = tuple((a + b) / 2 for a, b in zip(lowest, highest, strict=True))
    return {"low": lowest, "high": highest, None: middle}[end]


def speedup(entry: Mapping, plain: Mapping) -> float:
    """``entry``'s speedup over ``plain``: plain's seconds over the entry's, summed over the batches at
    matched lengths (:func:`matched_seconds`); the ratio of their rates where the lengths cannot be
    matched (the interval then says so: :func:`speedup_interval`). Equal lengths: the ratio of rates."""
    matched = matched_seconds(entry, plain)
    if matched is None:
        rate, p_rate = (sum(e["batch_tokens"]) / sum(e["batch_seconds"]) for e in (entry, plain))
        return rate / p_rate
    return float(matched[1].sum() / matched[0].sum())


def speedup_interval(entry: Mapping, plain: Mapping, level: float = 0.95, groups: Sequence[int] | None = None
                     ) -> tuple[float, float]:  # fmt: skip
    """A ``level`` confidence interval of ``entry``'s speedup over ``plain`` (two ``run_interleaved``
    entries over the same batches), paired batch by batch: Student's t interval of the mean log
    ratio of the two runs' seconds at matched lengths (:func:`matched_seconds`), exponentiated, its
    standard error the jackknife's over batches (the costs per token fitted again without each), so
    the fit's own uncertainty is in it; with equal lengths that is the usual standard error of a
    mean. Where the fit leaves the costs a segment, or only the bounds hold them (:func:`matched_seconds`),
    the interval spans those at both its ends. ``(0, inf)`` from a single batch, or where a run cannot
    be moved (a made-up time at or below 0).

    ``groups``: per batch, the prompt it ran (the same prompts measured in two rounds, concatenated):
    the jackknife then leaves out a prompt at a time, and the t quantile counts prompts, not runs
    (what a prompt favours, it favours in both rounds).

    Pairing removes what the prompts share (a long prompt is slow for both); what is left is the
    spread of the per-prompt speedups, and the t quantile keeps a few prompts honest: three that
    sped up 0.9x, 1.25x and 1.5x give about (0.63, 2.3), and no drafter is chosen on them. (A
    percentile bootstrap over four prompts once called plain decoding run twice "0.87-0.99x": it
    is too narrow for so few.)
    """
    from scipy import stats  # imported here: scipy.stats adds seconds to start-up; only intervals need it

    def mean_log(pair) -> float | None:
        return None if pair is None else float(np.log(pair[1] / pair[0]).mean())

    def without(group, end) -> float | None:
        keep = np.asarray(groups) != group
        kept = ({k: np.asarray(e[k], float)[keep] for k in ("batch_tokens", "batch_seconds")} for e in (entry, plain))
        return mean_log(matched_seconds(*kept, end=end))

    def interval(end) -> tuple[float, float]:
        """The interval with every fit's costs at one ``end`` of its segment (where a fit has one)."""
        center = mean_log(matched_seconds(entry, plain, end))
        if center is None:
            return 0.0, float("inf")
        leave_out = [without(g, end) for g in sorted(set(groups))]
        if any(v is None for v in leave_out):
            return 0.0, float("inf")
        leave_out = np.array(leave_out)
        error = np.sqrt((size - 1) / size * ((leave_out - leave_out.mean()) ** 2).sum())
        half = stats.t.ppf((1 + level) / 2, size - 1) * error
        return float(np.exp(center - half)), float(np.exp(center + half))

    matched_seconds(entry, plain)  # raises where the batches differ
    count = len(plain["batch_tokens"])
    groups = np.arange(count) if groups is None else groups
    if len(groups) != count:
        raise ValueError(f"groups names the prompt of each of the {count} batches; got {len(groups)}.")
    size = len(set(groups))
    if size < 2:
        return 0.0, float("inf")
    # Where costs are bounded but not told apart (matched_seconds), the true ones lie between the ends:
    # the interval spans both ends' (elsewhere the two are the same).
    lows, highs = zip(interval("low"), interval("high"), strict=True)
    return min(lows), max(highs)
