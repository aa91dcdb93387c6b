"""The speculative decoding loop, one for every chain drafter.

Prefill the target and the drafter; then, inside one jitted ``lax.while_loop``,
each step: the drafter proposes N tokens, the target scores the pending token
plus the N drafts in one forward, the vmapped chain verifier accepts a prefix
per row, each row's caches roll back to its own logical length, and end of
sequence and the token budget end each row on its own. When no row has a
draft (prompt lookup found nothing) the step is a plain one-token step
instead (``lax.cond`` between the two). The engine never looks inside the
drafter's state.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh

from jspec.decode import GenerationResult, batch_inputs, compile_once
from jspec.drafters import Context
from jspec.sampling import SamplingParams, probs_from_logits, sample_logits
from jspec.sharding import check_mesh, replicate
from jspec.tree import ancestor_mask, tree_attention_mask, verify_tree_batch
from jspec.verify import verify_chain_batch

__all__ = ["SpecConfig", "SpecResult", "SpeculativeDecoder", "acceptance_by_position"]


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static facts of one compiled loop: padded prompt length P, step budget M, end-of-sequence ids,
    and the KV slots prompts and budgets need (default P + M; :func:`jspec.decode.cache_slots`)."""

    prompt_len: int
    max_new: int
    eos_ids: tuple[int, ...]
    cache_len: int | None = None

    def capacity(self, width: int) -> int:
        """Cache slots: the prompts, their budget and one verify forward of ``width`` tokens."""
        return (self.cache_len or self.prompt_len + self.max_new) + width


@struct.dataclass
class _State:
    out: jax.Array  # int32[B, M + N + 1], generated tokens
    num_generated: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    ctx: Context
    cache: object  # target KVCache
    drafter: object  # the drafter's own state
    verify_steps: jax.Array  # int32[]: target forwards over drafts
    plain_steps: jax.Array  # int32[]: one-token steps (no row had a draft)
    emitted_in_verify: jax.Array  # int32[]: tokens emitted by verify steps (live rows)
    live_row_steps: jax.Array  # int32[]: sum over verify steps of live rows
    accept_hist: jax.Array  # int32[N + 1]: live verify rows by number accepted


@dataclasses.dataclass
class SpecResult(GenerationResult):
    """Adds what speculation did to :class:`jspec.decode.GenerationResult`."""

    num_draft: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    emitted_in_verify: int = 0
    live_row_steps: int = 0
    accept_hist: list[int] = dataclasses.field(default_factory=list)
    cache_lengths: list[int] = dataclasses.field(default_factory=list)  # target tokens committed per row

    @property
    def tau(self) -> float:
        """Tokens emitted per row per verify forward, the bonus token counted."""
        return self.emitted_in_verify / self.live_row_steps if self.live_row_steps else 0.0

    def acceptance_by_position(self) -> list[float]:
        return acceptance_by_position(self.accept_hist)

    def stats(self) -> dict:
        return super().stats() | {
            "tau": self.tau,
            "acceptance_by_position": self.acceptance_by_position(),
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "num_draft": self.num_draft,
        }


def acceptance_by_position(accept_hist) -> list[float]:
    """Per draft position i, the fraction of rows that reached i whose draft i was accepted.

    Args:
      accept_hist: [N + 1] counts of verify rows by number of drafts accepted.
    """
    hist = np.asarray(accept_hist)
    reached = hist[::-1].cumsum()[::-1]  # rows with at least i accepted
    return [float(reached[i + 1] / reached[i]) if reached[i] else 0.0 for i in range(len(hist) - 1)]


def _append(buf, start, tokens):
    """Writes tokens [B, K] into buf [B, C] at each row's start (writes past C are dropped)."""
    b, k = tokens.shape
    cols = start[:, None] + jnp.arange(k)[None, :]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, k))
    return buf.at[rows, cols].set(tokens, mode="drop")


def _emit(state: _State, tokens, count, max_new, eos_ids):
    """Appends ``count`` [B] of ``tokens`` [B, K] per live row, cut at EOS and at the budget."""
    k = tokens.shape[1]
    live = ~state.done
    if eos_ids:
        is_eos = jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32)) & (jnp.arange(k)[None, :] < count[:, None])
        first_eos = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1) + 1, k + 1)
        hit_eos = first_eos <= count
        count = jnp.minimum(count, first_eos)
    else:
        hit_eos = jnp.zeros_like(live)
    count = jnp.where(live, jnp.minimum(count, max_new - state.num_generated), 0)
    out = _append(state.out, state.num_generated, jnp.where(live[:, None], tokens, 0))
    num_generated = state.num_generated + count
    done = state.done | (live & (hit_eos | (num_generated >= max_new)))
    return out, num_generated, done


def _spec_decode(tgraph, tweights, drafter, dweights, prompts, lengths, max_new, params, key, config, verifier):
    target = nnx.merge(tgraph, tweights)
    n = drafter.num_draft
    num_nodes = getattr(drafter, "num_nodes", None)  # tree drafters: nodes per tree, root included
    b, p = prompts.shape
    capacity = config.capacity(num_nodes or n + 1)

    hidden_layers = drafter.hidden_layers  # what the drafter reads of the target, e.g. EAGLE's features
    cache = target.init_cache(b, capacity)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = target(prompts, positions, cache, num_new=lengths, logit_index=lengths - 1, hidden_layers=hidden_layers)
    first = sample_logits(jax.random.fold_in(key, 0), out.logits[:, 0], params)
    history = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompts)
    history = _append(history, lengths, first[:, None])
    ctx = Context(history, lengths + 1, lengths)
    dstate = drafter.init(dweights, prompts, ctx, capacity, params, out.hidden_states)

    init = _State(
        out=jnp.zeros((b, config.max_new + n + 1), jnp.int32),
        num_generated=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool),
        ctx=ctx,
        cache=out.cache,
        drafter=dstate,
        verify_steps=jnp.int32(0),
        plain_steps=jnp.int32(0),
        emitted_in_verify=jnp.int32(0),
        live_row_steps=jnp.int32(0),
        accept_hist=jnp.zeros((n + 1,), jnp.int32),
    )
    o, g, d = _emit(init, first[:, None], jnp.ones((b,), jnp.int32), max_new, config.eos_ids)
    init = dataclasses.replace(init, out=o, num_generated=g, done=d)

    def verify_step(s: _State, proposal, dstate, step_key):
        ctx = s.ctx
        keys = jax.random.split(step_key, b)
        if num_nodes:  # a tree: every node in one forward, each seeing its ancestors
            positions = ctx.cache_length[:, None] + proposal.depths
            mask = tree_attention_mask(ctx.cache_length, ancestor_mask(proposal.parents, n), capacity)
            out = target(proposal.tokens, positions, s.cache, mask, hidden_layers=hidden_layers)
            q = probs_from_logits(out.logits, params)
            verdict = verify_tree_batch(proposal.tokens, proposal.parents, proposal.used, proposal.probs, q, keys, n)
        else:  # a chain: the pending token and the N drafts
            tokens = jnp.concatenate([ctx.last[:, None], proposal.tokens], axis=1)  # [B, N + 1]
            positions = ctx.cache_length[:, None] + jnp.arange(n + 1)[None, :]
            out = target(tokens, positions, s.cache, hidden_layers=hidden_layers)
            q = probs_from_logits(out.logits, params)
            verdict = verifier(proposal.tokens, proposal.probs, q, keys)
        live = ~s.done
        a = jnp.where(live, verdict.num_accepted, 0)
        emitted = jnp.where(live, verdict.num_emitted, 0)
        kept = jnp.where(live, 1 + a, 0)  # finished rows keep their lengths: nothing they see changes
        hidden = out.hidden_states
        if num_nodes:  # the accepted path moves into place; the drafter sees it as a chain
            cache = out.cache.commit_path(ctx.cache_length, verdict.path, kept)
            hidden = tuple(jnp.take_along_axis(h, verdict.path[:, :, None], axis=1) for h in hidden)
        else:
            cache = out.cache.rollback(ctx.cache_length + kept)
        history = _append(ctx.history, ctx.length, verdict.tokens)
        new_ctx = Context(history, ctx.length + emitted, ctx.cache_length + kept)
        dstate = drafter.commit(dweights, dstate, new_ctx, a, hidden)
        o, g, d = _emit(s, verdict.tokens, emitted, max_new, config.eos_ids)
        return dataclasses.replace(
            s,
            out=o,
            num_generated=g,
            done=d,
            ctx=new_ctx,
            cache=cache,
            drafter=dstate,
            verify_steps=s.verify_steps + 1,
            emitted_in_verify=s.emitted_in_verify + jnp.sum(emitted),
            live_row_steps=s.live_row_steps + jnp.sum(live),
            accept_hist=s.accept_hist + jnp.zeros((n + 1,), jnp.int32).at[a].add(live.astype(jnp.int32)),
        )

    def plain_step(s: _State, proposal, dstate, step_key):
        ctx = s.ctx
        out = target(ctx.last[:, None], ctx.cache_length[:, None], s.cache, hidden_layers=hidden_layers)
        nxt = sample_logits(step_key, out.logits[:, 0], params)
        live = (~s.done).astype(jnp.int32)
        cache = out.cache.rollback(ctx.cache_length + live)
        new_ctx = Context(_append(ctx.history, ctx.length, nxt[:, None]), ctx.length + live, ctx.cache_length + live)
        dstate = drafter.commit(dweights, dstate, new_ctx, jnp.zeros((b,), jnp.int32), out.hidden_states)
        o, g, d = _emit(s, nxt[:, None], jnp.ones((b,), jnp.int32), max_new, config.eos_ids)
        return dataclasses.replace(
            s, out=o, num_generated=g, done=d, ctx=new_ctx, cache=cache, drafter=dstate,
            plain_steps=s.plain_steps + 1,
        )  # fmt: skip

    def body(s: _State):
        step = s.verify_steps + s.plain_steps + 1
        k_draft, k_step = jax.random.split(jax.random.fold_in(key, step))
        proposal, dstate = drafter.propose(dweights, s.drafter, s.ctx, k_draft, params)
        any_draft = jnp.any(proposal.has_draft & ~s.done)
        return jax.lax.cond(any_draft, verify_step, plain_step, s, proposal, dstate, k_step)

    final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, init)
    return final


_spec_jit = jax.jit(_spec_decode, static_argnums=(0, 2, 9, 10))


class SpeculativeDecoder:
    """Speculative decoding with any chain drafter; compiled loops are cached per bucket."""

    def __init__(
        self,
        target: nnx.Module,
        drafter,
        drafter_weights=(),
        eos_ids: tuple[int, ...] = (),
        verifier=verify_chain_batch,
        mesh: Mesh | None = None,
    ):
        """Args:
        target: the target model (see :mod:`jspec.decode` for the interface).
        drafter: a drafter from :mod:`jspec.drafters` (static, hashable).
        drafter_weights: its arrays (a draft model's NNX state), or ().
        eos_ids: tokens that end a row.
        verifier: the batched chain verifier; tests pass a broken one as a negative control.
        mesh: split every batch's rows over these devices, target and drafter weights
          replicated (:mod:`jspec.sharding`); the default runs on JAX's default device.
        """
        self.verifier = verifier
        check_mesh(mesh)
        self.mesh = mesh
        self.tgraph, self.tweights = nnx.split(target)
        self.tweights = replicate(mesh, self.tweights)
        self.drafter = drafter
        self.dweights = replicate(mesh, drafter_weights)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        config = target.config
        self.max_position, self.vocab_size = config.max_position, config.vocab_size
        self._compiled: dict = {}

    def generate(self, prompts, max_new_tokens: int, sampling: SamplingParams | None = None, seed: int = 0):
        batch = batch_inputs(prompts, max_new_tokens, self.vocab_size, self.max_position, self.mesh, sampling, seed)
        b, rows = len(prompts), batch.padded.shape[0]  # rows past b: filler for an even split, dropped below
        config = SpecConfig(batch.prompt_len, batch.max_new, self.eos_ids, batch.cache_len)
        args = (self.tgraph, self.tweights, self.drafter, self.dweights, *batch[:3], batch.sampling, batch.key)
        args = (*args, config, self.verifier)
        run, compile_s = compile_once(self._compiled, (rows, config), _spec_jit, args)
        dynamic = (args[1], *args[3:9])
        t0 = time.perf_counter()
        final = jax.block_until_ready(run(*dynamic))
        seconds = time.perf_counter() - t0
        out, counts = np.asarray(final.out), np.asarray(final.num_generated)
        verify, plain = int(final.verify_steps), int(final.plain_steps)
        return SpecResult(
            tokens=[out[i, : counts[i]].tolist() for i in range(b)],
            seconds=seconds,
            compile_seconds=compile_s,
            target_calls=1 + verify + plain,
            num_draft=self.drafter.num_draft,
            verify_steps=verify,
            plain_steps=plain,
            emitted_in_verify=int(final.emitted_in_verify),
            live_row_steps=int(final.live_row_steps),
            accept_hist=np.asarray(final.accept_hist).tolist(),
            cache_lengths=np.asarray(final.cache.lengths)[:b].tolist(),
        )
