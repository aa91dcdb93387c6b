"""Draft trees with static shapes, and their exact verification.

A tree has a fixed node budget T. Node 0 is the root: the pending token
(sampled, not yet fed to the target); nodes 1..T-1 are drafts. Per node:
its parent (the root's is 0), its depth (the root's is 0; a node's position
in the text is the root's position plus its depth) and whether it is used
(a dynamic tree or a lookup may fill fewer nodes than the budget). Parents
come before children in node order.

The target scores all nodes in one forward, each node attending to the
committed cache and to its own ancestors (:func:`ancestor_mask`). Drafters grow
their trees with :mod:`jspec.drafters.unroll` (EAGLE-2's dynamic selection too).

Verification (:func:`verify_tree`) walks down from the root. At a node u with
target distribution q, its children x_1, x_2, ... (in node order) are tried
in turn: child i, drawn from the drafter's distribution p_i, is accepted with
probability min(1, q'(x_i) / p_i(x_i)), where q' starts at q; on rejection
q' becomes the normalized residual (q' - p_i)+ and the next child is tried.
When a child is accepted the walk continues from it with that child's target
distribution; when all are rejected, the next token is drawn from q' and the
step ends; at a leaf the bonus token is drawn from the leaf's q.

Two kinds of drafts are exact under this one rule:

* deterministic children (top-k of the drafter, a lookup): p_i is one-hot, so
  child i is accepted with probability q'(x_i) and a rejection zeroes x_i in
  q' and renormalizes (the sequential sibling rule);
* sampled children (drawn independently from the drafter's distribution at
  u): p_i is that distribution for every sibling (multi-draft rejection
  sampling, as in SpecInfer).

Either way every emitted token is distributed as a draw from the target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core.sampling import sample
from jspec.core.verify import acceptance_probability, residual_distribution

__all__ = [
    "DynamicTreeSpec",
    "MeasuredTree",
    "StaticTree",
    "TreeVerdict",
    "ancestor_mask",
    "check_tree",
    "frontier_sizes",
    "parse_tree",
    "tree_attention_mask",
    "tree_text",
    "verify_tree",
    "verify_tree_batch",
]


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A tree whose shape is fixed before drafting (hashable: a static argument under jit).

    Attributes:
      parents: per node, its parent's index; node 0 (the root) has parent 0.
      branching: children per node at each depth, when the tree was made by
        :meth:`from_branching` (drafters that fill a tree depth by depth need it).
    """

    parents: tuple[int, ...]
    branching: tuple[int, ...] | None = None

    def __post_init__(self):
        p = self.parents
        if not p or p[0] != 0:
            raise ValueError(f"node 0 is the root and its own parent; got parents {p}.")
        for i, parent in enumerate(p[1:], start=1):
            if not 0 <= parent < i:
                raise ValueError(f"node {i}'s parent must be an earlier node; got {parent} (parents {p}).")

    @classmethod
    def from_branching(cls, branching: Sequence[int]) -> StaticTree:
        """Every node at depth d has ``branching[d]`` children: [2, 2, 2] gives 14 drafts, 8 paths.

        A chain of N drafts is ``[1] * N``.
        """
        branching = [int(b) for b in branching]
        if not branching or any(b < 1 for b in branching):
            raise ValueError(f"branching must be a non-empty list of positive ints, e.g. [2, 2, 2]; got {branching}.")
        parents, frontier = [0], [0]
        for b in branching:
            nxt = []
            for u in frontier:
                for _ in range(b):
                    parents.append(u)
                    nxt.append(len(parents) - 1)
            frontier = nxt
        return cls(tuple(parents), tuple(branching))

    @classmethod
    def chain(cls, num_draft: int) -> StaticTree:
        return cls.from_branching([1] * num_draft)

    @property
    def size(self) -> int:
        """Nodes, the root included."""
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        d = [0]
        for parent in self.parents[1:]:
            d.append(d[parent] + 1)
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def num_leaves(self) -> int:
        return self.size - len(set(self.parents[1:]))

    @property
    def fed_per_depth(self) -> tuple[int, ...]:
        """Nodes at each depth 1 .. max_depth - 1: what a drafter feeds to itself, one depth at a
        time, to draft the depth below (the root is fed before, the deepest nodes never)."""
        depths = self.depths
        return tuple(depths.count(d) for d in range(1, self.max_depth))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(parents int32[T], depths int32[T])."""
        return np.asarray(self.parents, np.int32), np.asarray(self.depths, np.int32)


@dataclasses.dataclass(frozen=True)
class DynamicTreeSpec:
    """EAGLE-2's knobs (see :func:`grow_dynamic_tree`): children per expanded node and nodes
    expanded per depth (``top_k``), ``depth``, and nodes kept (``total``, the root included).

    The defaults (4, 3, 8) suit a device where a forward over many tokens costs several
    one-token steps (a CPU; docs/log, draft trees); where it costs little more than one
    (a GPU), larger trees pay (the EAGLE-2 paper uses 10, 6, 60).
    """

    top_k: int = 4
    depth: int = 3
    total: int = 8

    def __post_init__(self):
        most = 1 + self.top_k + (self.depth - 1) * self.top_k**2
        if self.top_k < 1 or self.depth < 1 or not 2 <= self.total <= most:
            raise ValueError(
                f"a dynamic tree needs top_k >= 1, depth >= 1 and 2 <= total <= 1 + top_k + (depth - 1) * top_k**2 "
                f"= {most}; got top_k={self.top_k}, depth={self.depth}, total={self.total}."
            )

    @property
    def size(self) -> int:
        """Nodes verified, the root included."""
        return self.total

    @property
    def max_depth(self) -> int:
        return self.depth


@dataclasses.dataclass(frozen=True)
class MeasuredTree:
    """A static tree chosen when the drafter is built, from its measured acceptance at each depth
    and rank, within ``max_nodes`` nodes (the root included). Medusa heads save those rates when
    ``jspec train medusa`` ends (:func:`jspec.drafters.medusa.best_branching`)."""

    max_nodes: int = 16

    def __post_init__(self):
        if not isinstance(self.max_nodes, int) or self.max_nodes < 2:
            raise ValueError(f"a measured tree needs max_nodes >= 2 (the root and one draft); got {self.max_nodes!r}.")

    max_depth = None  # known once the rates are read


def frontier_sizes(tree: StaticTree | DynamicTreeSpec) -> list[int]:
    """Nodes a drafter feeds to itself at each depth 1 .. depth - 1 to draft the depth below."""
    if isinstance(tree, DynamicTreeSpec):
        return [tree.top_k] * (tree.depth - 1)
    if tree.branching is None:
        raise ValueError("a drafter fills static trees made by StaticTree.from_branching (e.g. [2, 2, 2]).")
    return list(tree.fed_per_depth)


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """bool[..., T, T]: [i, j] is True when node j is node i or one of its ancestors.

    Args:
      parents: int32[..., T], the root's parent being itself (node 0).
      max_depth: the deepest node's depth (static), bounding the pointer walk.
    """
    t = parents.shape[-1]
    eye = jnp.eye(t, dtype=bool)
    mask = jnp.broadcast_to(eye, (*parents.shape, t))
    cur = jnp.broadcast_to(jnp.arange(t), parents.shape)
    for _ in range(max_depth):
        cur = jnp.take_along_axis(parents, cur, axis=-1)
        mask = mask | jax.nn.one_hot(cur, t, dtype=bool)
    return mask


@struct.dataclass
class TreeVerdict:
    """What verifying one tree decided (add a leading B when batched).

    Attributes:
      path: int32[D + 1]; the accepted nodes from the root (path[0] = 0); slots
        after ``num_accepted`` hold 0 (the root: a valid index to gather with).
      num_accepted: int32[]; drafts accepted, 0..D.
      tokens: int32[D + 1]; the accepted drafts, then the correction or bonus
        token; slots at and after ``num_emitted`` hold ``pad_id``.
      num_emitted: int32[]; ``num_accepted + 1``.
      accepted: bool[D]; per depth, whether a draft was accepted there.
    """

    path: jax.Array
    num_accepted: jax.Array
    tokens: jax.Array
    num_emitted: jax.Array
    accepted: jax.Array


def check_tree(tokens, parents, used, max_depth) -> None:
    """Raises ValueError unless a tree's arrays are well formed and ``max_depth`` is at least its deepest
    used node's depth (a smaller one would end the walk early). Skipped for traced arrays; a leading batch
    axis is allowed."""
    if not isinstance(max_depth, (int, np.integer)) or isinstance(max_depth, bool) or max_depth < 1:
        raise ValueError(f"max_depth must be a positive int (static), got {max_depth!r}.")
    if any(isinstance(x, jax.core.Tracer) for x in (tokens, parents, used)):
        return
    tokens, parents, used = np.asarray(tokens), np.asarray(parents), np.asarray(used, bool)
    if not tokens.shape == parents.shape == used.shape or tokens.ndim not in (1, 2):
        raise ValueError(f"tokens, parents and used must share one shape [T] or [B, T]; got {tokens.shape}, "
                         f"{parents.shape}, {used.shape}.")  # fmt: skip
    parents2, used2 = parents.reshape(-1, parents.shape[-1]), used.reshape(-1, used.shape[-1])
    t = parents2.shape[1]
    if np.any((parents2[:, 1:] < 0) | (parents2[:, 1:] >= np.arange(1, t))):
        raise ValueError("every node's parent must come before it (0 <= parents[j] < j for j >= 1).")
    depth = np.zeros(parents2.shape, np.int64)
    for j in range(1, t):
        depth[:, j] = depth[np.arange(len(depth)), parents2[:, j]] + 1
    deepest = int(np.max(np.where(used2, depth, 0)))
    if deepest > max_depth:
        raise ValueError(f"max_depth is {max_depth} but the tree has a used node at depth {deepest}: the walk "
                         f"would stop before it and bias the next token; pass max_depth >= {deepest}.")  # fmt: skip


def verify_tree(tokens, parents, used, draft_probs, target_probs, key, max_depth: int, pad_id=0) -> TreeVerdict:
    """Walks one tree from the root and accepts a path (see the module docstring).

    Args:
      tokens: int32[T]; node tokens (the root's is the pending token, not checked).
      parents: int32[T]; parents before children, the root's parent 0.
      used: bool[T]; unused nodes are never tried.
      draft_probs: float32[T, V]; per node the distribution it was drawn from
        (the root's row is ignored); ``None`` when every draft was chosen
        deterministically (one-hot rows, handled without V-sized work per node).
      target_probs: float32[T, V]; the target's distribution after each node.
      key: PRNG key.
      max_depth: the deepest used node's depth or more (static; checked when the arrays are concrete).
      pad_id: value for the slots of ``tokens`` after the emitted ones.
    """
    check_tree(tokens, parents, used, max_depth)
    if draft_probs is None:
        return _verify_tree_deterministic(tokens, parents, used, target_probs, key, max_depth, pad_id)
    t = tokens.shape[0]
    walk_key, sample_key = jax.random.split(key)
    uniforms = jax.random.uniform(walk_key, (max_depth, t))
    p_tok = jnp.take_along_axis(draft_probs, tokens[:, None], axis=-1)[:, 0]  # p_j(x_j)

    def level(carry, u_row):
        node, q, stopped, num_acc, path = carry

        def try_child(inner, j):
            q, chosen = inner
            is_child = (parents[j] == node) & used[j] & (j > 0) & (chosen < 0) & ~stopped
            ok = u_row[j] < acceptance_probability(p_tok[j], q[tokens[j]])
            chosen = jnp.where(is_child & ok, j, chosen)
            q = jnp.where(is_child & ~ok, residual_distribution(q, draft_probs[j]), q)
            return (q, chosen), None

        (q, chosen), _ = jax.lax.scan(try_child, (q, jnp.int32(-1)), jnp.arange(t))
        accepted = chosen >= 0
        num_acc = num_acc + accepted.astype(jnp.int32)
        path = jnp.where(accepted, path.at[num_acc].set(chosen), path)
        node = jnp.where(accepted, chosen, node)
        q = jnp.where(accepted, target_probs[jnp.maximum(chosen, 0)], q)
        return (node, q, stopped | ~accepted, num_acc, path), None

    init = (jnp.int32(0), target_probs[0], jnp.bool_(False), jnp.int32(0), jnp.zeros((max_depth + 1,), jnp.int32))
    (_, q, _, num_acc, path), _ = jax.lax.scan(level, init, uniforms)
    # q is now the residual at the node where the walk stopped, or the leaf's target distribution.
    return _verdict(tokens, path, num_acc, sample(sample_key, q), max_depth, pad_id)


def _verdict(tokens, path, num_acc, next_token, max_depth: int, pad_id) -> TreeVerdict:
    """The accepted path's tokens followed by the correction or bonus token."""
    slots = jnp.arange(max_depth + 1)
    out = jnp.where(slots < num_acc, tokens[path[jnp.minimum(slots + 1, max_depth)]], pad_id)
    out = jnp.where(slots == num_acc, next_token, out).astype(jnp.int32)
    return TreeVerdict(path, num_acc, out, num_acc + 1, slots[:-1] < num_acc)


def _verify_tree_deterministic(tokens, parents, used, target_probs, key, max_depth: int, pad_id) -> TreeVerdict:
    """:func:`verify_tree` when every draft is one-hot: the sibling rule on scalars.

    Child j of node u (token x_j, earlier siblings rejected) is accepted with
    probability q_u(x_j) / (1 - mass of the rejected siblings' tokens); a sibling
    repeating an earlier sibling's token has probability 0. Where the walk stops,
    the next token is drawn from q_u without the tried children's tokens.
    """
    t = tokens.shape[0]
    walk_key, sample_key = jax.random.split(key)
    uniforms = jax.random.uniform(walk_key, (max_depth, t))
    nodes = jnp.arange(t)
    is_node = used & (nodes > 0)
    q_parent = target_probs[parents, tokens]  # q_{parent(j)}(x_j)
    siblings = parents[:, None] == parents[None, :]
    earlier_twin = siblings & (tokens[:, None] == tokens[None, :]) & (nodes[None, :] < nodes[:, None])
    q_parent = jnp.where(jnp.any(earlier_twin & is_node[None, :], axis=1), 0.0, q_parent)

    def level(carry, u_row):
        node, stopped, num_acc, path = carry

        def try_child(inner, j):
            removed, chosen = inner
            is_child = (parents[j] == node) & is_node[j] & (chosen < 0) & ~stopped
            ok = u_row[j] * jnp.maximum(1.0 - removed, 0.0) < q_parent[j]
            chosen = jnp.where(is_child & ok, j, chosen)
            removed = removed + jnp.where(is_child & ~ok, q_parent[j], 0.0)
            return (removed, chosen), None

        (_, chosen), _ = jax.lax.scan(try_child, (jnp.float32(0.0), jnp.int32(-1)), nodes)
        accepted = chosen >= 0
        num_acc = num_acc + accepted.astype(jnp.int32)
        path = jnp.where(accepted, path.at[num_acc].set(chosen), path)
        node = jnp.where(accepted, chosen, node)
        return (node, stopped | ~accepted, num_acc, path), None

    init = (jnp.int32(0), jnp.bool_(False), jnp.int32(0), jnp.zeros((max_depth + 1,), jnp.int32))
    (node, stopped, num_acc, path), _ = jax.lax.scan(level, init, uniforms)
    # Where the walk stopped at a rejection, every child of the node was tried; where it ran out of depth, none.
    tried = jnp.zeros_like(target_probs[0], dtype=bool).at[tokens].max((parents == node) & is_node & stopped)
    resid = jnp.where(tried, 0.0, target_probs[node])
    total = resid.sum()
    nxt = sample(sample_key, jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), target_probs[node]))
    return _verdict(tokens, path, num_acc, nxt, max_depth, pad_id)


def verify_tree_batch(tokens, parents, used, draft_probs, target_probs, keys, max_depth: int,
                      pad_id=0) -> TreeVerdict:  # fmt: skip
    """:func:`verify_tree` vmapped over a batch, each row with its own tree and key
    (``draft_probs`` None: every draft deterministic)."""
    check_tree(tokens, parents, used, max_depth)
    probs_axis = None if draft_probs is None else 0
    return jax.vmap(verify_tree, in_axes=(0, 0, 0, probs_axis, 0, 0, None, None))(
        tokens, parents, used, draft_probs, target_probs, keys, max_depth, pad_id
    )


def tree_attention_mask(cache_lengths, ancestors, capacity: int):
    """bool[B, T, S]: tree node i (written at slot ``cache_lengths + i``) sees the committed
    slots and the slots of its ancestors and itself.

    Args:
      cache_lengths: int32[B], committed slots per row.
      ancestors: bool[B, T, W] from :func:`ancestor_mask` (W = T), or any [B, T, W] map of which
        of the W slots after the committed ones each new token sees.
      capacity: S, static.
    """
    t = ancestors.shape[-1]  # W
    rel = jnp.arange(capacity)[None, :] - cache_lengths[:, None]  # [B, S]
    in_tree = (rel >= 0) & (rel < t)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (*ancestors.shape[:2], capacity))
    sees_node = jnp.take_along_axis(ancestors, idx, axis=2) & in_tree[:, None, :]
    return (rel < 0)[:, None, :] | sees_node


def parse_tree(tree, *, top_k: int | None = None, depth: int | None = None, total: int | None = None):
    """A draft shape from what a user writes: None or "chain" (a chain); "dynamic" (EAGLE-2, with
    ``top_k``, ``depth``, ``total`` or their defaults) or "dynamic:top_k=4,depth=3,total=8";
    "measured" (Medusa: the best static tree of at most ``total`` nodes for the heads' measured
    acceptance) or "measured:total=16"; a branching such as "2,2,2" or [2, 2, 2]; or a tree object."""
    if tree is None or tree == "chain":
        return None
    if isinstance(tree, StaticTree | DynamicTreeSpec | MeasuredTree):
        return tree
    if isinstance(tree, str) and tree.partition(":")[0] in ("dynamic", "measured"):
        kind, _, rest = tree.partition(":")
        sizes = {"top_k": top_k, "depth": depth, "total": total}
        for part in filter(None, rest.split(",")):
            key, _, value = part.partition("=")
            if key not in (sizes if kind == "dynamic" else {"total"}) or not value.isdigit():
                raise ValueError(f"tree {tree!r}: {kind} takes " + ("top_k=K,depth=D,total=T" if kind == "dynamic"
                                 else "total=T") + f"; got {part!r}.")  # fmt: skip
            sizes[key] = int(value)
        d = DynamicTreeSpec()  # the default size, a measured tree's too
        if kind == "measured":
            return MeasuredTree(sizes["total"] or d.total)
        return DynamicTreeSpec(sizes["top_k"] or d.top_k, sizes["depth"] or d.depth, sizes["total"] or d.total)
    if isinstance(tree, str):
        try:
            tree = [int(x) for x in tree.split(",")]
        except ValueError:
            raise ValueError(
                f"tree must be 'chain', 'dynamic', 'measured' or a branching list such as 2,2,2; got {tree!r}."
            ) from None
    if isinstance(tree, Sequence) and all(isinstance(x, int) for x in tree):
        return StaticTree.from_branching(tree)
    raise ValueError(f"tree must be 'chain', 'dynamic', a branching such as [2, 2, 2], a StaticTree or a "
                     f"DynamicTreeSpec; got {tree!r}.")  # fmt: skip


def tree_text(tree) -> str | None:
    """What :func:`parse_tree` reads back to ``tree`` (None for a chain)."""
    tree = parse_tree(tree)
    if tree is None:
        return None
    if isinstance(tree, DynamicTreeSpec):
        sizes = f"top_k={tree.top_k},depth={tree.depth},total={tree.total}"
        return "dynamic" if tree == DynamicTreeSpec() else f"dynamic:{sizes}"
    if isinstance(tree, MeasuredTree):
        return "measured" if tree.max_nodes == DynamicTreeSpec.total else f"measured:total={tree.max_nodes}"
    if tree.branching is None:
        raise ValueError("a static tree without a branching list has no text form; give it as a branching.")
    return ",".join(map(str, tree.branching))
