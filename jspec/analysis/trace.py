"""One speculative step laid open: what the drafter proposed and what the target accepted.

:func:`first_step` runs the first step of :class:`jspec.SpeculativeDecoder`'s loop outside it,
on one prompt, with the same keys: the draft (a chain or a tree), the target's verdict, the
accepted path. For looking at a drafter (notebooks draw its trees), never for speed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.core.sampling import SamplingParams, probs_from_logits, sample_logits
from jspec.core.tree import ancestor_mask, tree_attention_mask, verify_tree_batch
from jspec.core.verify import verify_chain_batch
from jspec.drafters.base import TreeProposal, check_drafter
from jspec.loop.engine import start

__all__ = ["StepTrace", "first_step"]


@dataclasses.dataclass
class StepTrace:
    """The first speculative step on one prompt (numpy arrays; a chain is a tree with one child per node).

    Attributes:
      first_token: the token sampled from the prefill, pending when the step starts (node 0).
      tokens: int[T]: node 0, then the drafts.
      parents: int[T]: each node's parent (node 0's is 0).
      depths: int[T].
      used: bool[T]: the nodes the drafter filled (a row may draft fewer than its shape holds).
      draft_logp: float[T]: log-probability of each node under the drafter's distribution
        (0 for node 0 and for deterministic children where the drafter gives none).
      target_logp: float[T]: log-probability the target gives each node after its parent.
      path: int[D + 1]: the accepted nodes from node 0.
      num_accepted: drafts accepted.
      emitted: the tokens the step adds (accepted drafts, then the correction or bonus; where the
        drafter found nothing to draft, the one token of the plain step the loop takes instead).
    """

    first_token: int
    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    used: np.ndarray
    draft_logp: np.ndarray
    target_logp: np.ndarray
    path: np.ndarray
    num_accepted: int
    emitted: list[int]


def first_step(target, drafter, prompt: list[int], sampling: SamplingParams | None = None, seed: int = 0) -> StepTrace:
    """The first step of ``SpeculativeDecoder(target, drafter).generate([prompt], ..., seed=seed)``.

    The same keys as that loop, so ``[first_token, *emitted]`` are its first tokens.
    """
    check_drafter(drafter)
    if drafter.num_lookahead:
        raise ValueError("first_step shows drafts and their verdict; a drafter with lookahead tokens is not supported.")
    if not prompt or not all(isinstance(t, int | np.integer) for t in prompt):
        raise ValueError("prompt must be a non-empty list of token ids.")
    params = SamplingParams.greedy() if sampling is None else sampling
    n = drafter.num_draft
    width = drafter.num_nodes or n + 1
    capacity = len(prompt) + width
    key = jax.random.PRNGKey(seed)
    prompts, lengths = jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32)
    out, first, ctx, state = start(target, drafter, prompts, lengths, capacity, params, key)
    k_draft, k_step = jax.random.split(jax.random.fold_in(key, 1))  # the loop's first step's keys
    proposal, _ = drafter.propose(state, ctx, k_draft, params)
    keys = jax.random.split(k_step, 1)
    if isinstance(proposal, TreeProposal):
        tokens, parents, depths, used = proposal.tokens, proposal.parents, proposal.depths, proposal.used
        mask = tree_attention_mask(ctx.cache_length, ancestor_mask(parents, n), capacity)
        logits = target(tokens, ctx.cache_length[:, None] + depths, out.cache, mask).logits
        q = probs_from_logits(logits, params)
        verdict = verify_tree_batch(tokens, parents, used, proposal.probs, q, keys, n)
        path = verdict.path[0]
    else:
        tokens = jnp.concatenate([ctx.last[:, None], proposal.tokens], axis=1)
        parents = jnp.maximum(jnp.arange(n + 1) - 1, 0)[None]
        depths = jnp.arange(n + 1)[None]
        count = n if proposal.num_drafts is None else proposal.num_drafts[0]
        used = (jnp.arange(n + 1) <= count)[None]
        logits = target(tokens, ctx.cache_length[:, None] + depths, out.cache).logits
        q = probs_from_logits(logits, params)
        extra = {} if proposal.num_drafts is None else {"num_drafts": proposal.num_drafts}
        verdict = verify_chain_batch(proposal.tokens, proposal.probs, q, keys, **extra)
        path = jnp.arange(n + 1)
    a = int(verdict.num_accepted[0])
    emitted = np.asarray(verdict.tokens[0, : a + 1]).tolist()
    # No draft: the loop takes a plain step, one token sampled with the step's key (None: always drafts).
    if proposal.has_draft is not None and not bool(proposal.has_draft[0]):
        emitted = [int(sample_logits(k_step, logits[:, 0], params)[0])]
    tok = np.asarray(tokens[0])
    parent = np.asarray(parents[0])
    # each node's token under the target's distribution after its parent (node 0: after the prompt)
    qa = np.asarray(q[0])
    target_logp = np.log(np.maximum(qa[parent, tok], 1e-30))
    target_logp[0] = 0.0
    draft_logp = np.zeros(len(tok))
    if proposal.probs is not None:
        pa = np.asarray(proposal.probs[0])  # a tree: a row per node; a chain: a row per draft
        drawn = (
            pa[np.arange(len(tok)), tok]
            if isinstance(proposal, TreeProposal)
            else np.r_[1.0, pa[np.arange(n), tok[1:]]]
        )
        draft_logp = np.log(np.maximum(drawn, 1e-30))
        draft_logp[0] = 0.0
    return StepTrace(
        first_token=int(first[0]),
        tokens=tok,
        parents=parent,
        depths=np.asarray(depths[0]),
        used=np.asarray(used[0]),
        draft_logp=draft_logp,
        target_logp=target_logp,
        path=np.asarray(path[: a + 1]),
        num_accepted=a,
        emitted=emitted,
    )
