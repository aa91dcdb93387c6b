"""Plain autoregressive decoding, the baseline every drafter is measured against.

The whole loop (prefill, then one token per step until every row has hit
end-of-sequence or its own ``max_new_tokens``) runs inside one jitted
``lax.while_loop``; nothing returns to the host per token. Prompt length and
the step budget are rounded up to buckets, so one compilation serves every
request in a bucket; per-row lengths, budgets, temperatures and keys are
arrays.

The model is any Flax NNX module with the target interface:
``model(tokens, positions, cache, mask=None, *, num_new=None, logit_index=None)``
returning an object with ``logits`` and ``cache``, and
``model.init_cache(batch, capacity)``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh

from jspec.sampling import SamplingParams, sample_logits
from jspec.sharding import check_mesh, padded_rows, replicate, shard_rows

__all__ = [
    "Batch",
    "DecodeConfig",
    "Decoder",
    "GenerationResult",
    "batch_inputs",
    "bucket",
    "cache_slots",
    "decode_loop",
    "jit_forward",
    "validate_prompts",
]


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum): a static length that serves many requests."""
    size = minimum
    while size < n:
        size *= 2
    return size


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static shape facts of one compiled decode loop (hashable: a jit static argument).

    Attributes:
      prompt_len: padded prompt length P.
      max_new: step budget M (per-row budgets are arrays <= M).
      eos_ids: token ids that end a row.
      cache_len: KV cache slots; default P + M. Every step attends over all of them, so a
        tighter cache is a faster step (:func:`cache_slots`).
    """

    prompt_len: int
    max_new: int
    eos_ids: tuple[int, ...]
    cache_len: int | None = None

    @property
    def capacity(self) -> int:
        return self.cache_len or self.prompt_len + self.max_new


def cache_slots(prompt_len: int, max_new: int, longest_prompt: int, max_new_tokens: int) -> int:
    """The KV cache a plain decode needs: every row's prompt and budget, bucketed (so that it
    still serves many requests), never more than the two buckets P + M, never less than P.

    Each step attends over every slot, and the buckets of prompt and budget can both be near
    twice what a request needs: a batch of 32 decoding SmolLM2 on CPU-2 took 378 ms per step
    with 512 slots and 233 ms with 256 (``experiments/batch_decode_cost.py``).
    """
    return min(prompt_len + max_new, max(prompt_len, bucket(longest_prompt + max_new_tokens)))


@struct.dataclass
class _LoopState:
    tokens: jax.Array  # int32[B, M], generated tokens
    num_generated: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    last: jax.Array  # int32[B], the latest token, not yet fed to the model
    cache: object
    step: jax.Array  # int32[], target forwards after prefill


@dataclasses.dataclass
class GenerationResult:
    """Host-side result of one batch.

    Attributes:
      tokens: per row, the generated ids (end-of-sequence included when hit).
      seconds: wall time of the run, compilation excluded.
      compile_seconds: time spent compiling for this call (0 when cached).
      target_calls: target forwards, prefill included.
    """

    tokens: list[list[int]]
    seconds: float
    compile_seconds: float
    target_calls: int

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")

    def stats(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "compile_seconds": self.compile_seconds,
            "target_calls": self.target_calls,
        }


def _is_eos(tokens, eos_ids):
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 7))
def decode_loop(graphdef, state, prompts, prompt_lengths, max_new, params, key, config: DecodeConfig):
    """The whole plain decode, jitted: prefill, then a ``lax.while_loop`` of one-token steps.

    Args are what :meth:`Decoder.generate` passes: the model split by ``nnx.split``
    (``graphdef`` static), :func:`batch_inputs`' arrays, sampling parameters, a PRNG key
    and the static :class:`DecodeConfig`. Returns (tokens int32[B, M], counts int32[B],
    target forwards). Called directly it lets an experiment choose the cache
    (``DecodeConfig.cache_len``); a cache shorter than a row's prompt plus budget drops
    that row's last keys and changes its output, so keep to :func:`cache_slots` or more.
    """
    model = nnx.merge(graphdef, state)
    b, p = prompts.shape
    cache = model.init_cache(b, config.capacity)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = model(prompts, positions, cache, num_new=prompt_lengths, logit_index=prompt_lengths - 1)
    first = sample_logits(jax.random.fold_in(key, 0), out.logits[:, 0], params)

    tokens = jnp.zeros((b, config.max_new), jnp.int32).at[:, 0].set(first)
    num_generated = jnp.minimum(max_new, 1)
    done = (max_new <= 1) | _is_eos(first, config.eos_ids)
    init = _LoopState(tokens, num_generated, done, first, out.cache, jnp.int32(0))

    def cond(s: _LoopState):
        return ~jnp.all(s.done)

    def body(s: _LoopState):
        step_out = model(s.last[:, None], s.cache.lengths[:, None], s.cache)
        step = s.step + 1
        nxt = sample_logits(jax.random.fold_in(key, step), step_out.logits[:, 0], params)
        live = ~s.done
        slot = jnp.minimum(s.num_generated, config.max_new - 1)
        tokens = s.tokens.at[jnp.arange(b), slot].set(jnp.where(live, nxt, s.tokens[jnp.arange(b), slot]))
        num_generated = s.num_generated + live.astype(jnp.int32)
        done = s.done | _is_eos(nxt, config.eos_ids) | (num_generated >= max_new)
        return _LoopState(tokens, num_generated, done, nxt, step_out.cache, step)

    final = jax.lax.while_loop(cond, body, init)
    return final.tokens, final.num_generated, final.step + 1


def jit_forward(model: nnx.Module):
    """The model split once and its forward jitted with the KV cache donated: ``(state, forward)``.

    ``forward(state, tokens, positions, cache)`` returns ``(logits, new_cache)``.
    The cache passed in is consumed (XLA writes the new one into its buffers),
    so keep only the returned one. This is for stepping a model from Python
    (notebooks, cost measurements); the generation loops keep their caches
    inside one jitted loop, where XLA updates them in place anyway.
    """
    graphdef, state = nnx.split(model)

    def forward(state, tokens, positions, cache):
        out = nnx.merge(graphdef, state)(tokens, positions, cache)
        return out.logits, out.cache

    return state, jax.jit(forward, donate_argnames="cache")


def pad_prompts(prompts, prompt_len: int) -> tuple[jax.Array, jax.Array]:
    """Right-pads token lists to [B, prompt_len]; returns (tokens int32[B, P], lengths int32[B])."""
    padded = np.zeros((len(prompts), prompt_len), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    return jnp.asarray(padded), jnp.asarray([len(p) for p in prompts], jnp.int32)


def compile_once(cache: dict, key, jitted, args) -> tuple[object, float]:
    """The compiled executable for ``key`` (compiling ahead of time on first use) and the seconds it took.

    Compiling before the run keeps compilation out of the timed loop.
    """
    t0 = time.perf_counter()
    if key not in cache:
        cache[key] = jitted.lower(*args).compile()
    return cache[key], time.perf_counter() - t0


def validate_prompts(prompts, max_new_tokens: int, vocab_size: int | None, max_position: int | None) -> None:
    """Raises ValueError, before anything is compiled, for requests that cannot run."""
    if not prompts:
        raise ValueError("no prompts given.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}.")
    for i, prompt in enumerate(prompts):
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


def batch_inputs(
    prompts,
    max_new_tokens: int,
    vocab_size: int | None,
    max_position: int | None,
    mesh: Mesh | None = None,
    sampling: SamplingParams | None = None,
    seed: int = 0,
) -> Batch:
    """A request made ready for a compiled loop, after :func:`validate_prompts` (both loops use it).

    With a ``mesh`` the rows are padded to a multiple of its devices with filler rows (the
    first prompt, a budget of one token; callers drop rows past ``len(prompts)``) and split
    over it (:mod:`jspec.sharding`), per-row sampling parameters with them; the key is
    replicated. ``sampling`` defaults to greedy.
    """
    validate_prompts(prompts, max_new_tokens, vocab_size, max_position)
    prompt_len, new_len = bucket(max(len(p) for p in prompts)), bucket(max_new_tokens)
    rows = padded_rows(mesh, len(prompts))
    padded, lengths = pad_prompts(list(prompts) + [prompts[0]] * (rows - len(prompts)), prompt_len)
    budget = jnp.where(jnp.arange(rows) < len(prompts), max_new_tokens, 1).astype(jnp.int32)
    slots = cache_slots(prompt_len, new_len, max(len(p) for p in prompts), max_new_tokens)
    padded, lengths, budget = shard_rows(mesh, (padded, lengths, budget), rows, rows)
    sampling = shard_rows(mesh, sampling or SamplingParams.greedy(), len(prompts), rows)
    key = replicate(mesh, jax.random.PRNGKey(seed))
    return Batch(padded, lengths, budget, prompt_len, new_len, slots, sampling, key)


class Decoder:
    """Plain decoding with a model split once; compiled loops are cached per bucket."""

    def __init__(
        self,
        model: nnx.Module,
        eos_ids: tuple[int, ...] = (),
        max_position: int | None = None,
        mesh: Mesh | None = None,
    ):
        """``mesh``: split every batch's rows over these devices, the weights replicated
        (:mod:`jspec.sharding`); the default runs on JAX's default device."""
        check_mesh(mesh)
        self.mesh = mesh
        self.graphdef, self.state = nnx.split(model)
        self.state = replicate(mesh, self.state)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.max_position = max_position or getattr(getattr(model, "config", None), "max_position", None)
        self.vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        self._compiled: dict = {}

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        seed: int = 0,
    ) -> GenerationResult:
        """Generates for a batch of prompts of any lengths.

        Args:
          prompts: token ids per row.
          max_new_tokens: the budget of every row.
          sampling: temperature/top-k/top-p (default greedy); scalars or per row.
          seed: PRNG seed.
        """
        batch = batch_inputs(prompts, max_new_tokens, self.vocab_size, self.max_position, self.mesh, sampling, seed)
        b, rows = len(prompts), batch.padded.shape[0]
        config = DecodeConfig(batch.prompt_len, batch.max_new, self.eos_ids, batch.cache_len)
        args = (self.graphdef, self.state, *batch[:3], batch.sampling, batch.key, config)
        run, compile_s = compile_once(self._compiled, (rows, config), decode_loop, args)
        t0 = time.perf_counter()
        tokens, counts, calls = run(*args[1:7])
        tokens, counts = np.asarray(tokens), np.asarray(counts)
        seconds = time.perf_counter() - t0
        return GenerationResult(
            tokens=[tokens[i, : counts[i]].tolist() for i in range(b)],
            seconds=seconds,
            compile_seconds=compile_s,
            target_calls=int(calls),
        )
