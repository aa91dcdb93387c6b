"""Plain autoregressive decoding, the baseline every drafter is measured against.

The whole loop (prefill, then one token per step until every row has hit
end-of-sequence or its own ``max_new_tokens``) runs inside one jitted
``lax.while_loop``; nothing returns to the host per token. Requests are made
ready by :func:`jspec.loop.batching.batch_inputs` (buckets, padding, budgets), so one
compilation serves every request in a bucket.

The model is any Flax NNX module with the target interface:
``model(tokens, positions, cache, mask=None, *, num_new=None, hidden_layers=(), logit_index=None)``
returning an object with ``logits``, ``hidden_states`` and ``cache``, and
``model.init_cache(batch, capacity)``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh

from jspec.core.sampling import sample_logits
from jspec.loop.batching import (
    LoopConfig,
    View,
    drive,
    jitted_programs,
    run_steps,
)
from jspec.loop.host import HostDecoder
from jspec.loop.results import GenerationResult
from jspec.loop.sharding import place_model

__all__ = ["Decoder", "PlainLoop", "decode_loop", "jit_forward", "plain_loop", "prefill"]


def prefill(model, prompts, lengths, capacity: int, hidden_layers: tuple[int, ...] = ()):
    """The right-padded prompts through a fresh cache of ``capacity`` slots (every loop starts here).

    Args:
      model: a model with the target interface (a target or a draft model).
      prompts: int32[B, P]; lengths: int32[B], each row's real prompt length.
      hidden_layers: layers whose hidden states to return (static).

    Returns:
      The model's output: logits float32[B, 1, V] at each row's last prompt token, the
      hidden states [B, P, H] at ``hidden_layers``, and a cache holding each row's prompt.
    """
    b, p = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cache = model.init_cache(b, capacity)
    return model(prompts, positions, cache, num_new=lengths, logit_index=lengths - 1, hidden_layers=hidden_layers)


@struct.dataclass
class _LoopState:
    tokens: jax.Array  # int32[B, M], generated tokens
    num_generated: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    last: jax.Array  # int32[B], the latest token, not yet fed to the model
    cache: object
    step: jax.Array  # int32[], target forwards after prefill


def _is_eos(tokens, eos_ids):
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


@dataclasses.dataclass(frozen=True)
class PlainLoop:
    """Everything static about one compiled plain loop: the model's graph and the shapes."""

    graphdef: nnx.GraphDef
    config: LoopConfig


@functools.partial(jax.jit, static_argnums=0, donate_argnames="state")
def plain_loop(loop: PlainLoop, weights, prompts, prompt_lengths, max_new, params, key, state=None, steps=None):
    """The plain decode, jitted (:func:`jspec.loop.batching.run_steps`): with ``state=None`` the prefill
    (and, given ``steps``, at most that many one-token steps after it); with a state, at most
    ``steps`` more steps from it. Returns ``(state, view)``; :func:`decode_loop` runs it to the end."""
    config = loop.config
    model = nnx.merge(loop.graphdef, weights)
    b = prompts.shape[0]

    def view(s: _LoopState):
        return s.tokens, s.num_generated, s.done

    if state is None:
        out = prefill(model, prompts, prompt_lengths, config.capacity())
        first = sample_logits(jax.random.fold_in(key, 0), out.logits[:, 0], params)
        tokens = jnp.zeros((b, config.max_new), jnp.int32).at[:, 0].set(first)
        num_generated = jnp.minimum(max_new, 1)
        done = (max_new <= 1) | _is_eos(first, config.eos_ids)
        state = _LoopState(tokens, num_generated, done, first, out.cache, jnp.int32(0))
        if steps is None:
            return state, View(*view(state))

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

    return run_steps(cond, body, state, steps, view)


def decode_loop(loop: PlainLoop, weights, prompts, prompt_lengths, max_new, params, key, on_tokens=None):
    """The whole plain decode: prefill, then a ``lax.while_loop`` of one-token steps (:func:`plain_loop`).

    Args are what :meth:`Decoder.generate` passes: the static :class:`PlainLoop`, the
    model's weights (``nnx.split``), :func:`jspec.loop.batching.batch_inputs`' arrays, sampling
    parameters and a PRNG key. Returns (tokens int32[B, M], counts int32[B], target
    forwards). Called directly it lets an experiment choose the cache
    (``LoopConfig.cache_len``); a cache shorter than a row's prompt plus budget drops
    that row's last keys and changes its output, so keep to
    :func:`jspec.loop.batching.cache_slots` or more.
    """
    args = (weights, prompts, prompt_lengths, max_new, params, key)
    final = drive(jitted_programs(plain_loop, loop), args, on_tokens)
    return final.tokens, final.num_generated, final.step + 1


def jit_forward(model: nnx.Module, mesh: Mesh | None = None):
    """The model split once (placed on ``mesh``: :func:`jspec.loop.sharding.place_model`; call it under
    ``jax.set_mesh(mesh)``) and its forward jitted with the KV cache donated: ``(state, forward)``.

    ``forward(state, tokens, positions, cache)`` returns ``(logits, new_cache)``.
    The cache passed in is consumed (XLA writes the new one into its buffers),
    so keep only the returned one. This is for stepping a model from Python
    (notebooks, cost measurements); the generation loops keep their caches
    inside one jitted loop, where XLA updates them in place anyway.
    """
    graphdef, state = place_model(mesh, model)

    def forward(state, tokens, positions, cache):
        out = nnx.merge(graphdef, state)(tokens, positions, cache)
        return out.logits, out.cache

    return state, jax.jit(forward, donate_argnames="cache")


class Decoder(HostDecoder):
    """Plain decoding with a model split once; compiled loops are cached per bucket (:class:`HostDecoder`)."""

    def __init__(
        self,
        model: nnx.Module,
        *,
        eos_ids: tuple[int, ...] = (),
        max_position: int | None = None,
        mesh: Mesh | None = None,
    ):
        """``mesh``: a ``("data", "model")`` mesh (:func:`jspec.loop.sharding.make_mesh`): rows split
        over ``data``, weights and KV cache over ``model`` (:mod:`jspec.loop.sharding`); the default
        runs on JAX's default device."""
        self._place(model, eos_ids, mesh, max_position)

    def loop_fn(self):
        return plain_loop

    def request(self, batch):
        return PlainLoop(self.graphdef, batch.config(self.eos_ids)), (self.weights, *batch.arrays())

    def result(self, final, rows: int, compile_seconds: float, seconds: float) -> GenerationResult:
        calls = int(final.step) + 1
        return GenerationResult(
            tokens=[final.tokens[i, : final.num_generated[i]].tolist() for i in range(rows)],
            seconds=seconds,
            compile_seconds=compile_seconds,
            target_calls=calls,
            plain_steps=calls - 1,
        )
