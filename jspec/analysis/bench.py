"""Running a decoder over a prompt set, and what the measured costs predict.

Shared by ``jspec bench`` and the benchmark scripts in ``experiments/``: one
function runs decoders over prompts taking turns and sums what they measured
(compilation apart), one predicts a speculative run's wall time from the
costs measured alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jspec.loop.batching import bucket
from jspec.loop.results import GenerationResult
from jspec.models.loading import progress as bar

__all__ = [
    "batches",
    "forget_compiled",
    "matched_seconds",
    "predicted_seconds",
    "run_interleaved",
    "run_prompts",
    "speedup",
    "speedup_interval",
    "turn_order",
    "warm_up",
]


def turn_order(n: int, turn: int) -> list[int]:
    """The order in which ``n`` decoders run in turn ``turn``: a Williams design, a Latin square in
    which each decoder also follows every other equally often (once in every ``n`` turns for even
    ``n``, twice in every ``2n`` for odd). A decoder measured right after a heavy program runs at
    another speed (3% after the EAGLE-3 head, docs/log 2026-12-01, "The order of decoders"); with the
    order only rotated, each decoder always followed the same one (``auto`` always after the draft
    model), so that bias never averaged out."""
    if n < 1:
        raise ValueError(f"need at least one decoder; got {n}.")
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...: the differences between neighbours are all distinct
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(j + r) % n for j in first] for r in range(n)]
    if n % 2:  # an odd square balances carryover only together with its mirror
        rows += [row[::-1] for row in rows]
    return rows[turn % len(rows)]


def warm_up(decoder, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, sampling, seed: int = 0,
            batch: int = 1, one_shape: bool = True) -> float:  # fmt: skip
    """Compiles and runs the loop the prompts will run once, untimed; returns the compile seconds.

    The first run of a freshly compiled loop is slower (0.3-0.5 s more for SmolLM2 here), so
    benchmarks run one first, at ``batch`` rows. ``one_shape``: every prompt runs in the loop sized
    for the longest (``pad_to``), one program per decoder; else one per length bucket (the
    prompt and cache sizes a lone request of that prompt would get), warmed with half the budget.
    """
    if one_shape:
        longest = max(prompt_ids, key=len)
        return decoder.generate([list(longest)] * batch, max_new_tokens, sampling, seed=seed,
                                pad_to=len(longest)).compile_seconds  # fmt: skip
    budget = min(max_new_tokens, bucket(max_new_tokens) // 2 + 1)
    seconds = 0.0
    for _, prompt in sorted({bucket(len(p)): p for p in prompt_ids}.items()):
        seconds += decoder.generate([list(prompt)] * batch, budget, sampling, seed=seed).compile_seconds
    return seconds


def forget_compiled(decoders) -> None:
    """Drops the decoders' compiled loops (an auto decoder's too) and JAX's caches. A sweep over many
    decoders in one process needs it: XLA on CPU maps each compiled SmolLM2 loop into ~2,000 memory
    regions of its own, and Linux allows a process 65,530 (``vm.max_map_count``; docs/library.md)."""

    for decoder in decoders:
        forget_compiled(getattr(decoder, "_decoders", {}).values())
        getattr(decoder, "_compiled", {}).clear()
    jax.clear_caches()


def batches(prompt_ids: Sequence[Sequence[int]], batch: int) -> list[list[list[int]]]:
    """The prompts in batches of ``batch`` rows, in order; the last batch is filled up from the start
    (every batch has the same number of rows, so one compiled loop serves them all)."""
    if batch < 1 or not prompt_ids:
        raise ValueError(f"need prompts and batch >= 1; got {len(prompt_ids)} prompts, batch {batch}.")
    count = -(-len(prompt_ids) // batch)
    return [[list(prompt_ids[(i * batch + j) % len(prompt_ids)]) for j in range(batch)] for i in range(count)]


def run_interleaved(
    decoders: Mapping[str, object],
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling,
    seed: int = 0,
    batch: int = 1,
    rotate: bool = True,
    progress: bool = False,
    one_shape: bool = True,
    journal: str | os.PathLike | None = None,
) -> dict[str, dict]:
    """Every decoder on every prompt (alone, or in batches of ``batch``), taking turns batch by batch.

    Taking turns spreads drift in the machine's speed (it is shared) over all
    decoders alike, so their ratios stay meaningful; the order changes from batch to batch
    (:func:`turn_order`), so that each decoder runs right after every other equally often (a fixed
    order biases the one that follows a heavy program: docs/log, "The order of decoders"). Each decoder is warmed up
    first (:func:`warm_up`); compilation is reported apart, never timed.

    Args:
      decoders: name -> a :class:`jspec.loop.decode.Decoder` or :class:`jspec.loop.engine.SpeculativeDecoder`.
      prompt_ids: token ids per prompt; batch i is generated with seed ``seed + i``.
      batch: rows per call (:func:`batches`).
      rotate: change the order from batch to batch (:func:`turn_order`; False: always in the given order).
      progress: a progress bar on stderr (where it is a terminal, or JSPEC_PROGRESS is set).
      one_shape: every batch runs in the loop sized for the longest prompt (one compiled program per
        decoder: the tuner's 8 MT-bench prompts needed 4 per decoder, prompt and cache sizes
        differing); False: each batch in its own bucket, as a lone request would run.
      journal: a file that keeps every finished batch (all decoders' results, one JSON line each). A
        run killed midway and started again with the same arguments and journal runs only the batches
        it lacks (a Qwen 1.5B cell of 24 long prompts takes hours on a CPU); one written for other
        decoder names, prompts, sampling or seed is refused, never mixed in. Decoders are known by
        name only: a decoder configured anew under the same name needs a journal of its own.

    Returns:
      name -> :meth:`jspec.loop.results.GenerationResult.stats` of its runs summed: ``new_tokens``,
      ``seconds`` (the loops alone), ``compile_seconds``, ``target_calls``, ``tokens_per_s``,
      ``tau`` (1.0 for plain decoding) and, for speculative decoders, ``verify_steps``,
      ``plain_steps`` and ``acceptance_by_position``; ``calls``, the number of batches run;
      ``batch_tokens`` and ``batch_seconds``, per batch (what :func:`speedup_interval` pairs);
      ``resumed_batches``, how many came from the journal.
    """
    names = list(decoders)
    todo = batches(prompt_ids, batch)
    key = {"decoders": names, "prompts": hashlib.sha256(json.dumps(todo).encode()).hexdigest(),
           "max_new_tokens": max_new_tokens, "sampling": repr(sampling), "seed": seed,
           "order": "williams" if rotate else "fixed",
           "one_shape": one_shape}  # fmt: skip
    kept = _open_journal(pathlib.Path(journal), key) if journal is not None else {}
    missing = len(kept) < len(todo)  # nothing to compile where the journal holds every batch
    compile_s = {
        name: warm_up(decoder, prompt_ids, max_new_tokens, sampling, seed, batch, one_shape) if missing else 0.0
        for name, decoder in decoders.items()
    }
    pad_to = max(len(p) for p in prompt_ids) if one_shape else None
    found = {}
    rounds = enumerate(todo)
    if progress:
        rounds = bar(rounds, "benchmarking", total=len(todo))
    for i, rows in rounds:
        if i in kept:
            found[i] = kept[i]
            continue
        order = [names[j] for j in turn_order(len(names), i)] if rotate else names
        found[i] = {name: decoders[name].generate(rows, max_new_tokens, sampling, seed=seed + i, pad_to=pad_to)
                    for name in order}  # fmt: skip
        if journal is not None:
            line = {"batch": i, "results": {name: dataclasses.asdict(r) for name, r in found[i].items()}}
            _write(pathlib.Path(journal), "a", json.dumps(line) + "\n")
    runs = {name: [found[i][name] for i in range(len(todo))] for name in names}
    totals = {name: GenerationResult.total(results) for name, results in runs.items()}
    for name, total in totals.items():
        total.compile_seconds += compile_s[name]
    return {
        name: total.stats() | {"calls": len(runs[name]), "batch_tokens": [r.new_tokens for r in runs[name]],
                               "batch_seconds": [r.seconds for r in runs[name]], "resumed_batches": len(kept)}
        for name, total in totals.items()
    }  # fmt: skip


def _open_journal(path: pathlib.Path, key: dict) -> dict[int, dict[str, GenerationResult]]:
    """The batches a journal holds, by index, ready for more: a new one gets its key line; a torn last
    line (the run was killed while writing it) is cut off. Any other damage, or another run's key, is
    refused and the file left as it is."""
    text = path.read_text() if path.exists() else ""
    complete, _, torn = text.rpartition("\n")
    lines = complete.split("\n") if complete else []
    start = '{"batch": ' if lines else '{"key": '
    if torn and not (torn.startswith(start) or start.startswith(torn)):
        raise ValueError(f"{path} does not end as a journal does; it is damaged or not a journal. Delete it, or pass "
                         "another path.")  # fmt: skip
    entries = []
    for n, line in enumerate(lines):
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {n + 1} is not JSON; the journal is damaged. Delete it to start the run "
                             "again from its first batch.") from None  # fmt: skip
    if entries and entries[0] != {"key": key}:
        raise ValueError(f"{path} is the journal of another run (other decoders, prompts, sampling or seed): delete "
                         "it, or pass a journal of its own to this run.")  # fmt: skip
    try:
        kept = {e["batch"]: {name: GenerationResult(**r) for name, r in e["results"].items()} for e in entries[1:]}
    except (KeyError, TypeError) as error:
        raise ValueError(
            f"{path}: an entry is malformed ({error}); the journal is damaged. Delete it to start again."
        ) from None
    if torn or not entries:  # cut what a killed write left, or start the journal
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, "w", complete + "\n" if entries else json.dumps({"key": key}) + "\n")
    return kept


def _write(path: pathlib.Path, mode: str, text: str) -> None:
    """Writes and flushes to disk, so a batch recorded survives the process being killed."""
    with path.open(mode) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def matched_seconds(entry: Mapping, plain: Mapping, end: str | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """Each batch's seconds for ``entry`` and ``plain`` (two :func:`run_interleaved` entries over the same
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
    its middle by default; :func:`speedup_interval` takes both ends and spans them.

    Returns:
      (entry's seconds, plain's seconds) at matched lengths, or None where the lengths differ and the
      costs are not bounded that way (each decoder always ran to one length of its own).
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
    if not known.any() and np.linalg.matrix_rank(design) != 2:
        return None
    from scipy.optimize import lsq_linear  # here, as scipy.stats below: only sampled pairs need it

    # (Above 0 for the solver, where a made-up run has a time at or below 0: its cost is then held at 0.)
    top = [max(float(np.min(s[n > 0] / n[n > 0])), 1e-12) for s, n in ((seconds, tokens), (p_seconds, p_tokens))]
    # The first column is the entry's own fixed time; where a cost is not told apart, it merges with
    # it: f + cost * T for the entry's (from 0 up), f - cost * T for plain's (from -top * T up).
    low = 0.0 if known[1] or not known.any() else -top[1] * float(p_tokens[0])
    columns = [0] + [1 + i for i in range(2) if known[i] or not known.any()]
    bounds = np.array([[low, np.inf]] + [[0.0, top[i - 1]] for i in columns[1:]]).T
    fit = lsq_linear(design[:, columns], seconds - p_seconds, bounds=tuple(bounds), method="bvls").x
    if not known.any():  # the fit is one point of a segment of costs that fit alike: go to the end asked
        direction = np.linalg.svd(design)[2][-1]  # the design's null space: one dimension (rank 2)
        direction = direction if direction[1] > 0 or (direction[1] == 0 and direction[2] >= 0) else -direction
        moving = np.abs(direction) > 1e-12
        steps = (bounds[:, moving] - fit[moving]) / direction[moving]
        lowest, highest = float(np.max(steps.min(axis=0))), float(np.min(steps.max(axis=0)))
        fit = fit + direction * {"low": lowest, "high": highest, None: (lowest + highest) / 2}[end]
    costs = dict(zip(columns[1:], fit[1:], strict=True))
    cost, p_cost = costs.get(1, 0.0), costs.get(2, 0.0)
    common = (tokens + p_tokens) / 2 if known.all() or not known.any() else (p_tokens if known[0] else tokens)
    moved, p_moved = seconds + cost * (common - tokens), p_seconds + p_cost * (common - p_tokens)
    return (moved, p_moved) if (moved > 0).all() and (p_moved > 0).all() else None


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
    """A ``level`` confidence interval of ``entry``'s speedup over ``plain`` (two :func:`run_interleaved`
    entries over the same batches), paired batch by batch: Student's t interval of the mean log
    ratio of the two runs' seconds at matched lengths (:func:`matched_seconds`), exponentiated, its
    standard error the jackknife's over batches (the costs per token fitted again without each), so
    the fit's own uncertainty is in it; with equal lengths that is the usual standard error of a
    mean. Where the fit leaves the costs a segment (:func:`matched_seconds`), the interval spans those
    at both its ends. ``(0, inf)`` from a single batch, or where the lengths cannot be matched.

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


def run_prompts(decoder, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, sampling, seed: int = 0,
                progress: bool = False) -> dict:  # fmt: skip
    """One decoder over the prompts; see :func:`run_interleaved`."""
    return run_interleaved({"_": decoder}, prompt_ids, max_new_tokens, sampling, seed, progress=progress)["_"]


def predicted_seconds(
    entry: Mapping,
    step_seconds: float,
    prefill_seconds: float,
    relative_cost: Mapping[int, float],
    draft_units: float,
    plain_units: float = 0.0,
    prefill_units: float = 0.0,
    width: int | None = None,
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
      width: tokens in one verify forward (a tree's nodes); default N + 1.
    """
    n = len(entry["acceptance_by_position"])
    verify = entry["verify_steps"] * (relative_cost[width or n + 1] + draft_units)
    plain = entry["plain_steps"] * (1.0 + plain_units)
    return prefill_seconds * (1.0 + prefill_units) + step_seconds * (verify + plain)
