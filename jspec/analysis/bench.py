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

from jspec.loop.batching import bucket
from jspec.loop.results import GenerationResult
from jspec.models.loading import progress as bar

__all__ = [
    "batches",
    "forget_compiled",
    "predicted_seconds",
    "run_interleaved",
    "run_prompts",
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
      ``batch_tokens`` and ``batch_seconds``, per batch (what :func:`~jspec.analysis.paired.speedup_interval` pairs);
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
