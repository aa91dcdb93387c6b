"""The speculative decoding loop, one for all drafters.

Prefill the target and the drafter; then, inside one jitted ``lax.while_loop``,
each step: the drafter proposes a chain of N tokens or a tree, the target scores
the pending token and the drafts (and any lookahead tokens) in one forward, the
vmapped verifier accepts a prefix or a path per row, each row's caches roll back
to its length (a tree's accepted path moved into place first), and EOS and the
budget end each row. A step where no row has a draft is a plain one
(:func:`jspec.loop.control.cond`). The engine knows drafters only through
:class:`jspec.drafters.base.Drafter`. An :class:`Adaptive` policy may take a plain step, or
verify a narrower chain, where that pays more.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh

from jspec.core.sampling import probs_from_logits, sample_logits
from jspec.core.tree import tree_attention_mask
from jspec.core.verify import verify_chain_batch
from jspec.drafters.base import (
    Context,
    Feedback,
    check_drafter,
    check_step_width,
    merge_drafter,
    split_drafter,
)
from jspec.loop.adaptive import Adaptive, StepCosts, check_widths, narrow_verify, worth_speculating
from jspec.loop.batching import LoopConfig, View, run_steps
from jspec.loop.control import cond, when
from jspec.loop.decode import prefill
from jspec.loop.host import HostDecoder
from jspec.loop.results import GenerationResult
from jspec.loop.sharding import replicate

__all__ = [
    "AdaptiveState",
    "LoopState",
    "SpecLoop",
    "SpeculativeDecoder",
    "StepStats",
    "merge_drafter",
    "speculative_loop",
    "split_drafter",
]


@struct.dataclass
class StepStats:
    """What the loop counts (read by :meth:`SpeculativeDecoder.generate`, never by a step)."""

    verify_steps: jax.Array  # int32[]: target forwards over drafts
    plain_steps: jax.Array  # int32[]: one-token steps (no row had a draft, or the adaptive fallback)
    emitted_in_verify: jax.Array  # int32[]: tokens emitted by verify steps (live rows)
    live_row_steps: jax.Array  # int32[]: sum over verify steps of live rows
    drafts_verified: jax.Array  # int32[]: sum over verify steps of the live rows' drafts verified (chains)
    accept_hist: jax.Array  # int32[N + 1]: live verify rows by number accepted
    fallback_steps: jax.Array  # int32[]: plain steps the adaptive policy chose (counted in plain_steps too)

    @classmethod
    def zeros(cls, n: int) -> StepStats:
        z = jnp.int32(0)
        return cls(z, z, z, z, z, jnp.zeros((n + 1,), jnp.int32), z)


@struct.dataclass
class AdaptiveState:
    """The adaptive policy's running state (unused by a loop that speculates every step)."""

    accepted_estimate: jax.Array  # float32[B]: running mean of drafts accepted per verify step
    since_speculated: jax.Array  # int32[]: plain steps in a row chosen by the policy
    probe_interval: jax.Array  # int32[]: fallback steps before the next probe (doubles while probes fail)


@struct.dataclass
class LoopState:
    """The decode (tokens, context, caches, the drafter's state), its statistics and the adaptive state."""

    out: jax.Array  # int32[B, M + N + 1], generated tokens
    num_generated: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    ctx: Context
    cache: object  # target KVCache
    drafter: object  # the drafter's own state
    stats: StepStats
    adaptive: AdaptiveState


@dataclasses.dataclass(frozen=True)
class SpecLoop:
    """Everything static about one compiled speculative loop (a jit static argument).

    Attributes:
      graphdef: the target's NNX graph.
      drafter: the drafter's pytree structure (its static facts; its arrays are arguments).
      config: the request's shapes (:class:`jspec.loop.batching.LoopConfig`).
      verifier: the batched chain verifier; tests pass a broken one as a negative control.
      adaptive: the fallback policy, or None to speculate every step.
    """

    graphdef: nnx.GraphDef
    drafter: jax.tree_util.PyTreeDef
    config: LoopConfig
    verifier: Callable = verify_chain_batch
    adaptive: Adaptive | None = None


def _append(buf, start, tokens):
    """Writes tokens [B, K] into buf [B, C] at each row's start (writes past C are dropped)."""
    b, k = tokens.shape
    cols = start[:, None] + jnp.arange(k)[None, :]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, k))
    return buf.at[rows, cols].set(tokens, mode="drop")


def _emit(state: LoopState, tokens, count, max_new, eos_ids):
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


def _split_logits(logits, width: int):
    """(the verified block's logits [B, W, V], the lookahead tokens' [B, E, V])."""
    return logits[:, :width], logits[:, width:]


def start(target, drafter, prompts, lengths, capacity: int, params, key):
    """The prefill every speculative decode begins with: (the target's output, its first token [B],
    the :class:`Context`, the drafter's initial state); shared with :func:`jspec.analysis.trace.first_step`."""
    b, p = prompts.shape
    out = prefill(target, prompts, lengths, capacity, drafter.hidden_layers)
    first = sample_logits(jax.random.fold_in(key, 0), out.logits[:, 0], params)
    history = _append(jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompts), lengths, first[:, None])
    ctx = Context(history, lengths + 1, lengths)
    return out, first, ctx, drafter.init(prompts, ctx, capacity, params, out.hidden_states)


@functools.partial(jax.jit, static_argnums=0, donate_argnames="state")
def speculative_loop(loop: SpecLoop, target_weights, drafter_leaves, prompts, lengths, max_new, params, key,
                     costs: StepCosts | None = None, state: LoopState | None = None, steps=None):  # fmt: skip
    """The speculative decode, jitted (``state``, ``steps``: :func:`jspec.loop.batching.run_steps`).

    Args:
      loop: the static :class:`SpecLoop`.
      target_weights: the target's NNX state; drafter_leaves: the drafter's arrays
        (:func:`split_drafter`), put back into ``loop.drafter``.
      prompts, lengths, max_new, params, key: :meth:`jspec.loop.batching.Batch.arrays`.
      costs: :class:`StepCosts` for an adaptive loop (``loop.adaptive``), else None.
    """
    config = loop.config
    target = nnx.merge(loop.graphdef, target_weights)
    drafter = merge_drafter(loop.drafter, drafter_leaves)
    n, num_nodes, extra = drafter.num_draft, drafter.num_nodes, drafter.num_lookahead
    width = num_nodes or n + 1  # the verified block: a tree's nodes, or the pending token + N drafts
    b = prompts.shape[0]
    capacity = config.capacity(width + extra)
    hidden_layers = drafter.hidden_layers  # what the drafter reads of the target (EAGLE's features)
    widths = () if loop.adaptive is None else loop.adaptive.widths  # an adaptive draft length's

    view = lambda s: (s.out, s.num_generated, s.done)  # noqa: E731
    if state is None:
        out, first, ctx, dstate = start(target, drafter, prompts, lengths, capacity, params, key)
        prior = n if loop.adaptive is None or loop.adaptive.prior is None else loop.adaptive.prior
        init = LoopState(
            out=jnp.zeros((b, config.max_new + n + 1), jnp.int32),
            num_generated=jnp.zeros((b,), jnp.int32),
            done=jnp.zeros((b,), bool),
            ctx=ctx,
            cache=out.cache,
            drafter=dstate,
            stats=StepStats.zeros(n),
            adaptive=AdaptiveState(
                accepted_estimate=jnp.full((b,), prior, jnp.float32),
                since_speculated=jnp.int32(0),
                probe_interval=jnp.int32(1 if loop.adaptive is None else loop.adaptive.probe_every),
            ),
        )
        o, g, d = _emit(init, first[:, None], jnp.ones((b,), jnp.int32), max_new, config.eos_ids)
        state = dataclasses.replace(init, out=o, num_generated=g, done=d)
        if steps is None:
            return state, View(*view(state))

    def verify_step(s: LoopState, proposal, dstate, step_key):
        ctx = s.ctx
        keys = jax.random.split(step_key, b)
        tokens, offsets, local = proposal.block(ctx.last, n)  # a chain's pending token and drafts, or a tree
        if proposal.lookahead is not None:
            tokens, offsets, local = proposal.lookahead.append_to(tokens, offsets, local)
        mask = None if local is None else tree_attention_mask(ctx.cache_length, local, capacity)
        positions = ctx.cache_length[:, None] + offsets
        counts = proposal.draft_counts()
        if widths:  # an adaptive draft length: the forward at the width worth the most tokens per cost
            out, counts = narrow_verify(target, drafter, proposal, ~s.done, costs, widths, tokens, positions, s.cache,
                                        hidden_layers)  # fmt: skip
        else:
            out = target(tokens, positions, s.cache, mask, hidden_layers=hidden_layers)
        verify_logits, lookahead_logits = _split_logits(out.logits, width)
        q = probs_from_logits(verify_logits, params)
        verdict = proposal.verify(q, keys, n, counts, loop.verifier)
        live = ~s.done
        a = jnp.where(live, verdict.num_accepted, 0)
        emitted = jnp.where(live, verdict.num_emitted, 0)
        kept = jnp.where(live, 1 + a, 0)  # finished rows keep their lengths: nothing they see changes
        hidden = tuple(h[:, :width] for h in out.hidden_states)
        cache, hidden = proposal.commit(out.cache, ctx.cache_length, verdict, kept, hidden)
        history = _append(ctx.history, ctx.length, verdict.tokens)
        new_ctx = Context(history, ctx.length + emitted, ctx.cache_length + kept)
        lookahead_logits = None if proposal.lookahead is None else lookahead_logits
        dstate = drafter.commit(dstate, new_ctx, Feedback(a, hidden, lookahead_logits))
        o, g, d = _emit(s, verdict.tokens, emitted, max_new, config.eos_ids)
        policy = s.adaptive
        if loop.adaptive is not None:
            decay = loop.adaptive.decay
            estimate = jnp.where(live, decay * policy.accepted_estimate + (1 - decay) * a, policy.accepted_estimate)
            worth = worth_speculating(estimate, live, costs)
            interval = jnp.where(worth, loop.adaptive.probe_every,
                                 jnp.minimum(2 * policy.probe_interval, loop.adaptive.max_probe_every))  # fmt: skip
            policy = AdaptiveState(estimate, policy.since_speculated, interval)
        stats = s.stats
        stats = dataclasses.replace(
            stats,
            verify_steps=stats.verify_steps + 1,
            emitted_in_verify=stats.emitted_in_verify + jnp.sum(emitted),
            live_row_steps=stats.live_row_steps + jnp.sum(live),
            drafts_verified=stats.drafts_verified + proposal.drafts_verified(live, n, counts),
            accept_hist=stats.accept_hist + jnp.zeros((n + 1,), jnp.int32).at[a].add(live.astype(jnp.int32)),
        )
        return dataclasses.replace(
            s, out=o, num_generated=g, done=d, ctx=new_ctx, cache=cache, drafter=dstate, stats=stats,
            adaptive=dataclasses.replace(policy, since_speculated=jnp.int32(0)),
        )  # fmt: skip

    def plain_step(s: LoopState, dstate, step_key, proposed=True):
        """One token from the target; ``proposed`` (bool or bool[]): the drafter proposed (no drafts) or not."""
        ctx = s.ctx
        out = target(ctx.last[:, None], ctx.cache_length[:, None], s.cache, hidden_layers=hidden_layers)
        nxt = sample_logits(step_key, out.logits[:, 0], params)
        live = (~s.done).astype(jnp.int32)
        cache = out.cache.rollback(ctx.cache_length + live)
        new_ctx = Context(_append(ctx.history, ctx.length, nxt[:, None]), ctx.length + live, ctx.cache_length + live)
        feedback = Feedback(jnp.zeros((b,), jnp.int32), out.hidden_states, proposed=proposed)
        dstate = drafter.commit(dstate, new_ctx, feedback)
        o, g, d = _emit(s, nxt[:, None], jnp.ones((b,), jnp.int32), max_new, config.eos_ids)
        stats = dataclasses.replace(s.stats, plain_steps=s.stats.plain_steps + 1,
                                    fallback_steps=s.stats.fallback_steps + jnp.where(proposed, 0, 1))  # fmt: skip
        policy = dataclasses.replace(
            s.adaptive, since_speculated=jnp.where(proposed, 0, s.adaptive.since_speculated + 1)
        )
        return dataclasses.replace(s, out=o, num_generated=g, done=d, ctx=new_ctx, cache=cache, drafter=dstate,
                                   stats=stats, adaptive=policy)  # fmt: skip

    def body(s: LoopState):
        step = s.stats.verify_steps + s.stats.plain_steps + 1
        k_draft, k_step = jax.random.split(jax.random.fold_in(key, step))
        propose = lambda dstate: drafter.propose(dstate, s.ctx, k_draft, params)  # noqa: E731
        if loop.adaptive is None:
            go = True
            proposal, dstate = propose(s.drafter)
        else:  # a proposal only where speculating pays (or a probe is due); else zeros, never read
            policy = s.adaptive
            go = worth_speculating(policy.accepted_estimate, ~s.done, costs) | (
                policy.since_speculated >= policy.probe_interval
            )
            shapes = jax.eval_shape(propose, s.drafter)
            empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[0])
            proposal, dstate = when(go, lambda c: propose(c[1]), (empty, s.drafter))
        # A lookahead window needs the target's logits every step it proposes; a drafter whose rows always
        # have drafts (has_draft None) is verified whenever it proposed: a fixed loop then compiles no plain
        # step, which could never run (the loop runs while a row is live), and no second target forward.
        always = proposal.lookahead is not None or proposal.has_draft is None
        verify = go if always else jnp.logical_and(go, jnp.any(proposal.has_draft & ~s.done))
        if verify is True:
            return verify_step(s, proposal, dstate, k_step)
        # One plain step for both no drafts and a fallback: the one-token forward compiles once.
        s = dataclasses.replace(s, drafter=dstate)  # carried, so that its caches too stay in place
        return cond(verify, lambda s: verify_step(s, proposal, s.drafter, k_step),
                    lambda s: plain_step(s, s.drafter, k_step, proposed=go), s)  # fmt: skip

    return run_steps(lambda s: ~jnp.all(s.done), body, state, steps, view)


class SpeculativeDecoder(HostDecoder):
    """Speculative decoding with any drafter; compiled loops are cached per bucket (:class:`HostDecoder`)."""

    def __init__(
        self,
        target: nnx.Module,
        drafter,
        *,
        eos_ids: tuple[int, ...] = (),
        verifier: Callable = verify_chain_batch,
        mesh: Mesh | None = None,
        adaptive: Adaptive | None = None,
        costs: StepCosts | None = None,
    ):
        """Args:
        target: the target model (see :mod:`jspec.loop.decode` for the interface).
        drafter: a :class:`jspec.drafters.base.Drafter` with its weights (:func:`jspec.make_drafter`).
        eos_ids: tokens that end a row.
        verifier: the batched chain verifier (tests pass a broken one: a negative control).
        mesh: a ``("data", "model")`` mesh (:func:`jspec.loop.sharding.make_mesh`): rows split over
          ``data``, the target's weights and KV cache over ``model``, the drafter's replicated.
        adaptive: fall back to plain steps where speculation does not pay (:class:`Adaptive`);
          needs ``costs``.
        costs: what a speculative and a plain step cost here (:class:`StepCosts`).
        """
        check_drafter(drafter)
        check_step_width(drafter, getattr(target.config, "max_position", None))
        if (adaptive is None) != (costs is None):
            raise ValueError("an adaptive loop needs both adaptive= (the policy) and costs= (StepCosts.create or "
                             "StepCosts.from_profile); pass both or neither.")  # fmt: skip
        if adaptive is not None and not isinstance(adaptive, Adaptive):
            raise ValueError(f"adaptive must be an Adaptive; got {type(adaptive).__name__}.")
        if costs is not None and not isinstance(costs, StepCosts):
            raise ValueError(f"costs must be a StepCosts; got {type(costs).__name__}.")
        if adaptive is not None and adaptive.widths:
            check_widths(drafter, adaptive.widths, costs)
        self._place(target, eos_ids, mesh)
        self.adaptive, self.costs = adaptive, replicate(mesh, costs)
        self.verifier = verifier
        self.drafter = drafter
        self._drafter_def, leaves = split_drafter(drafter)
        self._drafter_leaves = replicate(mesh, leaves)

    def loop_fn(self):
        return speculative_loop

    def request(self, batch):
        loop = SpecLoop(self.graphdef, self._drafter_def, batch.config(self.eos_ids), self.verifier, self.adaptive)
        return loop, (self.weights, self._drafter_leaves, *batch.arrays(), self.costs)

    def result(self, final: LoopState, rows: int, compile_seconds: float, seconds: float) -> GenerationResult:
        out, counts, stats = final.out, final.num_generated, final.stats
        verify, plain = int(stats.verify_steps), int(stats.plain_steps)
        return GenerationResult(
            tokens=[out[i, : counts[i]].tolist() for i in range(rows)],
            seconds=seconds,
            compile_seconds=compile_seconds,
            target_calls=1 + verify + plain,
            num_draft=self.drafter.num_draft,
            verify_steps=verify,
            plain_steps=plain,
            emitted_in_verify=int(stats.emitted_in_verify),
            live_row_steps=int(stats.live_row_steps),
            accept_hist=np.asarray(stats.accept_hist).tolist(),
            cache_lengths=np.asarray(final.cache.lengths)[:rows].tolist(),
            fallback_steps=int(stats.fallback_steps),
            drafts_verified=int(stats.drafts_verified),
        )
