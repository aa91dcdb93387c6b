"""Requests made ready for a compiled loop: validation, length buckets, padding, budgets, placement.

Both loops (plain and speculative) take their inputs from :func:`batch_inputs`
and their static facts from one :class:`LoopConfig`. Prompt length and the step
budget are rounded up to buckets, so one compilation serves every request in a
bucket; per-row lengths, budgets, temperatures and keys are arrays.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jspec.core.sampling import SamplingParams
from jspec.loop.sharding import padded_rows, replicate, shard_rows, to_host
from jspec.loop.xla_cache import enable_compilation_cache

__all__ = [
    "Batch",
    "CompiledLoops",
    "LoopConfig",
    "batch_inputs",
    "bucket",
    "cache_slots",
    "compile_loop",
    "compile_request",
    "drive",
    "jitted_programs",
    "loops_compiled",
    "max_compiled",
    "pad_prompts",
    "run_steps",
    "validate_prompts",
]


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum): a static length that serves many requests."""
    size = minimum
    while size < n:
        size *= 2
    return size


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static facts of one compiled generation loop (hashable: a jit static argument).

    Attributes:
      prompt_len: padded prompt length P.
      max_new: step budget M (per-row budgets are arrays <= M).
      eos_ids: token ids that end a row.
      cache_len: KV cache slots for prompts and budget; default P + M. Every step attends
        over all of them, so a tighter cache is a faster step (:func:`cache_slots`).
    """

    prompt_len: int
    max_new: int
    eos_ids: tuple[int, ...] = ()
    cache_len: int | None = None

    def capacity(self, width: int = 0) -> int:
        """Cache slots: the prompts, their budget and one forward of ``width`` tokens past them."""
        return (self.cache_len or self.prompt_len + self.max_new) + width


ALL_STEPS = 2**31 - 1  # a ``steps`` that runs a loop to its end


class View(NamedTuple):
    """What leaves the device between a resumed loop's segments: every row's tokens so far, how
    many are valid, and whether it has finished."""

    tokens: jax.Array  # int32[B, C]
    counts: jax.Array  # int32[B]
    done: jax.Array  # bool[B]


def run_steps(cond: Callable, body: Callable, state, steps, view: Callable):
    """At most ``steps`` more iterations of ``lax.while_loop(cond, body, state)``: (state, ``view(state)``).

    Every generation loop is written as ``loop(..., state, steps)``: with ``state=None`` and no
    ``steps`` it is the prefill alone (the first state); with ``state=None`` and ``steps`` the
    prefill and the loop; with a state, the loop resumed from it. None of them holds a host
    callback, so JAX's persistent compilation cache keeps each one (a program with a callback is
    never kept), and a listener sees the tokens between segments (:func:`drive`).
    """

    def more(carry):
        s, i = carry
        return cond(s) & (i < steps)

    def step(carry):
        s, i = carry
        return body(s), i + 1

    state, _ = jax.lax.while_loop(more, step, (state, jnp.int32(0)))
    return state, View(*view(state))


class Programs(NamedTuple):
    """A loop's compiled programs (:func:`run_steps`): ``whole`` (prefill and loop, one program) for
    a call nobody listens to; ``start`` and ``resume`` for one streamed to a listener."""

    whole: object = None
    start: object = None
    resume: object = None


def drive(run: Programs, args: tuple, on_tokens: Callable | None = None):
    """Runs a loop (compiled by :func:`compile_loop` for ``args``, or the jitted loop itself) to its
    end; returns the final state.

    Without a listener it is the ``whole`` program: the prefill and one ``lax.while_loop`` to the
    end, no host round trip. With one, ``start`` runs the prefill and ``resume`` one step at a time
    (the state donated), the next step always queued before the previous one's view is read, so
    the device never waits for ``on_tokens(tokens, counts)`` (numpy: every row's tokens so far and
    how many are valid), which sees the prefill's first token and then every step's.
    """
    if on_tokens is None:
        return run.whole(*args, None, np.int32(ALL_STEPS))[0]
    state, seen = run.start(*args, None, None)
    while True:
        nxt, upcoming = run.resume(*args, state, np.int32(1))  # queued before `seen` is read
        tokens, counts, done = to_host(seen)
        on_tokens(tokens, counts)
        if done.all():
            return nxt  # the queued segment ran no step
        state, seen = nxt, upcoming


def jitted_programs(jitted, static) -> Programs:
    """The jitted loop as :class:`Programs` (compiled on first call), for callers that pass the static
    argument themselves (experiments, tests)."""
    call = functools.partial(jitted, static)
    return Programs(call, call, call)


def check_listener(on_tokens: Callable | None, mesh: Mesh | None) -> None:
    if on_tokens is None:
        return
    if not callable(on_tokens):
        raise ValueError(f"on_tokens must be a function of (tokens, counts); got {type(on_tokens).__name__}.")
    if mesh is not None and mesh.is_multi_process:
        raise ValueError("on_tokens streams to one process; a mesh over several processes returns the tokens at "
                         "the end: pass on_tokens=None.")  # fmt: skip


def cache_slots(prompt_len: int, max_new: int, longest_prompt: int, max_new_tokens: int) -> int:
    """The KV cache a plain decode needs: every row's prompt and budget, bucketed (so that it
    still serves many requests), never more than the two buckets P + M, never less than P.

    Each step attends over every slot, and the buckets of prompt and budget can both be near
    twice what a request needs, so a step's cost grows with the slots kept
    (``experiments/costs/batch_decode_cost.py`` measures it).
    """
    return min(prompt_len + max_new, max(prompt_len, bucket(longest_prompt + max_new_tokens)))


def pad_prompts(prompts, prompt_len: int) -> tuple[jax.Array, jax.Array]:
    """Right-pads token lists to [B, prompt_len]; returns (tokens int32[B, P], lengths int32[B])."""
    padded = np.zeros((len(prompts), prompt_len), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    return jnp.asarray(padded), jnp.asarray([len(p) for p in prompts], jnp.int32)


class CompiledLoops(dict):
    """A decoder's compiled loops by static config. All decoders' loops together are capped
    (:func:`max_compiled`): a long-lived process serving many shapes keeps the most recently used."""


_RECENT: collections.OrderedDict = collections.OrderedDict()  # (id(cache), hash(key)) -> (its cache, key, fn)
_COMPILED = [0]


def max_compiled() -> int:
    """How many compiled loops a process keeps alive (``JSPEC_MAX_COMPILED``, default 16). On CPU each
    compiled SmolLM2 loop maps ~2,000 memory regions and Linux allows a process 65,530; past the cap
    the least recently used loop is dropped (and compiled again if its shape returns)."""
    value = os.environ.get("JSPEC_MAX_COMPILED", "16")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"JSPEC_MAX_COMPILED must be a whole number >= 1; got {value!r}.")
    return int(value)


def _compile_stream(jitted, args, mesh: Mesh | None) -> Programs:
    """Lowers the start and the resume, then compiles them at once in two threads (XLA releases the
    GIL), which shortens a cold start (docs/log, 2026-12-03, time to first token). Over a mesh
    the resume takes the shardings the start's compilation chose, so it waits for it."""
    steps = jax.ShapeDtypeStruct((), jnp.int32)
    if mesh is not None:
        start = jitted.lower(*args, None, None).compile()
        return Programs(start=start, resume=jitted.lower(*args, start.out_info[0], steps).compile())
    lowered = jitted.lower(*args, None, None)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), lowered.out_info[0])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = pool.submit(lowered.compile)
        resume = jitted.lower(*args, state, steps).compile()
        return Programs(start=start.result(), resume=resume)


def compile_loop(cache: CompiledLoops, key, jitted, args, mesh: Mesh | None = None,
                 stream: bool = False) -> tuple[Programs, float]:  # fmt: skip
    """The compiled programs of the loop ``jitted(*args, state, steps)`` for ``key`` (compiling ahead
    of time on first use) and the seconds it took: the ``whole`` loop, or with ``stream`` the
    ``start`` and the ``resume`` (lowered for the shapes and placements of the start's state,
    which it takes donated; :func:`drive`). ``key`` must tell the two kinds apart.

    Compiling before the run keeps compilation out of the timed loop; with a ``mesh`` it is
    compiled for it (what :func:`jspec.loop.sharding.constrain` reads).
    """
    t0 = time.perf_counter()
    if key not in cache:
        enable_compilation_cache()
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            if stream:
                cache[key] = _compile_stream(jitted, args, mesh)
            else:
                cache[key] = Programs(whole=jitted.lower(*args, None, jax.ShapeDtypeStruct((), jnp.int32)).compile())
        _COMPILED[0] += 1
    # Hashing a loop's key walks the model's graph (~1 ms for SmolLM2): once here, never per entry.
    ident = (id(cache), hash(key))
    _RECENT[ident] = (weakref.ref(cache), key, jitted)
    _RECENT.move_to_end(ident)
    dropped = set()
    while len(_RECENT) > max_compiled():  # entries of decoders gone or cleared since are dropped first
        _, (ref, old_key, fn) = _RECENT.popitem(last=False)
        owner = ref()
        if owner is not None and owner.pop(old_key, None) is not None:
            dropped.add(fn)
    for fn in dropped:  # the jitted function's own cache holds the executable too; the kept ones stay usable
        fn.clear_cache()
    return cache[key], time.perf_counter() - t0


def compile_request(cache: CompiledLoops, rows: int, loop, jitted, args, mesh: Mesh | None, on_tokens):
    """:func:`compile_loop` for a request of ``rows`` rows: the whole loop, or when someone listens
    (``on_tokens``) the streamed pair, each kind under a key of its own."""
    stream = on_tokens is not None
    key = (rows, loop, "streamed") if stream else (rows, loop)
    return compile_loop(cache, key, jitted, (loop, *args), mesh, stream)


def loops_compiled() -> int:
    """How many loops this process has compiled (every decoder, every miss of :func:`compile_loop`)."""
    return _COMPILED[0]


def _host_lists(prompts):
    """Arrays (a [B, T] array, or rows that are arrays) as Python lists; anything else unchanged."""
    if isinstance(prompts, np.ndarray | jax.Array):
        return np.asarray(prompts).tolist() if np.ndim(prompts) == 2 else prompts
    if isinstance(prompts, Sequence) and not isinstance(prompts, str | bytes):
        return [np.asarray(p).tolist() if isinstance(p, np.ndarray | jax.Array) else p for p in prompts]
    return prompts


def _is_token_list(prompt) -> bool:
    return isinstance(prompt, Sequence | np.ndarray) and not isinstance(prompt, str | bytes)


def validate_prompts(prompts, max_new_tokens: int, vocab_size: int | None, max_position: int | None) -> None:
    """Raises ValueError, before anything is compiled, for requests that cannot run.

    ``prompts`` is a batch: a list of token-id lists, one per row (numpy or JAX rows are read as lists).
    """
    prompts = _host_lists(prompts)
    if isinstance(prompts, str | bytes):
        raise ValueError(
            "prompts must be a list of token-id lists; got a string. Tokenize it first "
            "(tokenizer.encode) or use jspec.Speculator, which takes text."
        )
    if not _is_token_list(prompts):
        raise ValueError(f"prompts must be a list of token-id lists; got {type(prompts).__name__}.")
    if len(prompts) == 0:
        raise ValueError("no prompts given.")
    if all(isinstance(p, int | np.integer) for p in prompts):
        raise ValueError("prompts is a flat list of token ids; a batch is a list of such lists: pass [ids].")
    if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a whole number >= 1; got {max_new_tokens!r}.")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str | bytes):
            raise ValueError(f"prompt {i} is a string; tokenize it first, or use jspec.Speculator, which takes text.")
        if not _is_token_list(prompt):
            raise ValueError(f"prompt {i} must be a list of integer token ids; got {type(prompt).__name__}.")
        bad = next((t for t in prompt if not isinstance(t, int | np.integer)), None)
        if bad is not None:
            raise ValueError(f"prompt {i} must be a list of integer token ids; it holds {bad!r} "
                             f"({type(bad).__name__}). Tokenize text first.")  # fmt: skip
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; give at least one token.")
        if vocab_size is not None and (min(prompt) < 0 or max(prompt) >= vocab_size):
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}).")
        need = len(prompt) + max_new_tokens
        if max_position is not None and need > max_position:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; with max_new_tokens {max_new_tokens} that needs "
                f"{need} cache slots but the model's context holds {max_position}. Shorten the "
                "prompt or lower max_new_tokens."
            )


class Batch(NamedTuple):
    """A request made ready for a compiled loop: arrays, then the static sizes that pick the program."""

    padded: jax.Array  # int32[B, P], right-padded prompts
    lengths: jax.Array  # int32[B]
    budget: jax.Array  # int32[B], max_new_tokens per row
    prompt_len: int  # P, the prompt bucket
    max_new: int  # M, the new-token bucket
    cache_len: int  # KV slots for prompts and budget (:func:`cache_slots`); loops add what they verify
    sampling: SamplingParams  # scalars, or per row padded like the prompts
    key: jax.Array  # the request's PRNG key

    @property
    def rows(self) -> int:
        """Rows in the arrays: the prompts and any filler rows for an even split over a mesh."""
        return self.padded.shape[0]

    def config(self, eos_ids: tuple[int, ...]) -> LoopConfig:
        return LoopConfig(self.prompt_len, self.max_new, tuple(eos_ids), self.cache_len)

    def arrays(self) -> tuple:
        """What a compiled loop takes besides the weights: prompts, lengths, budgets, sampling, key."""
        return self.padded, self.lengths, self.budget, self.sampling, self.key


def batch_inputs(
    prompts,
    max_new_tokens: int,
    vocab_size: int | None,
    max_position: int | None,
    mesh: Mesh | None = None,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    on_tokens: Callable | None = None,
    pad_to: int | None = None,
) -> Batch:
    """A request made ready for a compiled loop, after :func:`validate_prompts` and a check of the
    listener ``on_tokens`` (both loops use it).

    ``pad_to``: sizes the request as if its longest prompt had at least this many tokens (prompt
    bucket and cache), so that one compiled loop serves every batch of a prompt set (a benchmark
    passes the set's longest prompt); the tokens are the same, each step attends over more slots.

    With a ``mesh`` the rows are padded to a multiple of its data axis with filler rows (the
    first prompt, a budget of one token; callers drop rows past ``len(prompts)``) and split
    over it (:mod:`jspec.loop.sharding`), per-row sampling parameters with them; the key is
    replicated. ``sampling`` defaults to greedy.
    """
    validate_prompts(prompts, max_new_tokens, vocab_size, max_position)
    check_listener(on_tokens, mesh)
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise ValueError(
            f"sampling must be a SamplingParams (SamplingParams.create(...)); got {type(sampling).__name__}."
        )
    prompts = [[int(t) for t in p] for p in _host_lists(prompts)]
    if pad_to is not None and (isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < 1):
        raise ValueError(f"pad_to must be a positive token count (the longest prompt to size for), got {pad_to!r}.")
    longest = max([len(p) for p in prompts] + [pad_to or 0])
    prompt_len, new_len = bucket(longest), bucket(max_new_tokens)
    rows = padded_rows(mesh, len(prompts))
    padded, lengths = pad_prompts(prompts + [prompts[0]] * (rows - len(prompts)), prompt_len)
    budget = jnp.where(jnp.arange(rows) < len(prompts), max_new_tokens, 1).astype(jnp.int32)
    slots = cache_slots(prompt_len, new_len, longest, max_new_tokens)
    padded, lengths, budget = shard_rows(mesh, (padded, lengths, budget), rows, rows)
    sampling = shard_rows(mesh, sampling or SamplingParams.greedy(), len(prompts), rows)
    key = replicate(mesh, jax.random.PRNGKey(seed))
    return Batch(padded, lengths, budget, prompt_len, new_len, slots, sampling, key)
