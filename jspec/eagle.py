"""EAGLE draft heads and their chain drafter.

A head is one decoder layer that drafts from the target's own hidden states
("features") instead of from text alone:

* **EAGLE-3**: the hidden states of a low, a middle and a high target layer
  (default 2, L/2 and L - 3) are fused by a linear 3H -> H. The layer's
  attention reads the normalized token embedding joined to the normalized
  feature (2H -> q, k, v); its residual stream is the feature. A final norm
  and an output layer over a *draft vocabulary* (the K most frequent target
  tokens of the training data) give the draft distribution. After the first
  draft step the head's own output hidden state is the next step's feature,
  which is what training-time test (:mod:`jspec.train_eagle`) teaches it.
* **EAGLE-1**: the top layer's hidden state joined to the token embedding, a
  linear 2H -> H, a plain decoder layer that predicts the next top-layer
  feature, and the target's own final norm and output layer (frozen copies,
  restricted to the draft vocabulary).

Pairs: the head's input at sequence position t + 1 is (feature of token t,
token t + 1); its output predicts token t + 2. The head keeps its own KV cache
(one layer) outside the module, like the target.

The head holds a frozen copy of the target's embedding (and for EAGLE-1 its
output rows) in :class:`Frozen` variables: put there when the head is built
for a target, never trained, never saved with the trained weights.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jspec.cache import KVCache
from jspec.drafters import Context, Proposal, TreeProposal
from jspec.models.llama import apply_rope, attention, linear, rms_norm
from jspec.sampling import SamplingParams, probs_from_logits, sample
from jspec.tree import StaticTree, grow_dynamic_tree, grow_static_tree, tree_attention_mask

__all__ = [
    "KINDS", "DraftHead", "DynamicTreeSpec", "EagleDrafter", "Frozen", "HeadConfig",
    "draft_vocabulary", "load_head", "save_head", "target_to_draft", "ttt_mask",
]  # fmt: skip

KINDS = ("eagle3", "eagle1")


class Frozen(nnx.Variable):
    """Arrays a head carries but does not train: the target's embedding, the vocabulary map,
    and for EAGLE-1 the target's output layer rows and final norm."""


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """Static facts of a head: the target's attention shapes, the vocabularies, the feature layers."""

    kind: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    feature_layers: tuple[int, ...]
    num_target_layers: int

    @classmethod
    def for_target(cls, target, kind: str = "eagle3", draft_vocab_size: int = 8192, feature_layers=None):
        """A head shaped for a target :class:`jspec.models.config.ModelConfig`; raises ValueError on bad options."""
        if kind not in KINDS:
            raise ValueError(f"unknown head kind {kind!r}; choose from {', '.join(KINDS)}.")
        n = target.num_layers
        if feature_layers is None:
            feature_layers = (2, n // 2, n - 3) if kind == "eagle3" else (n - 1,)
        feature_layers = tuple(int(x) for x in feature_layers)
        if kind == "eagle1" and len(feature_layers) != 1:
            raise ValueError(f"an EAGLE-1 head reads one (the top) layer; got {feature_layers}.")
        if not feature_layers or any(not 0 <= x < n for x in feature_layers):
            raise ValueError(f"feature layers {feature_layers} must be between 0 and {n - 1} (the target has {n}).")
        if not 1 <= draft_vocab_size <= target.vocab_size:
            raise ValueError(f"draft vocabulary size {draft_vocab_size} must be in [1, {target.vocab_size}].")
        t = target
        return cls(kind, t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim, t.intermediate_size, t.rms_eps,
                   t.rope_theta, t.vocab_size, int(draft_vocab_size), feature_layers, n)  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HeadConfig:
        d = json.loads(text)
        return cls(**(d | {"feature_layers": tuple(d["feature_layers"])}))


class DraftHead(nnx.Module):
    """One decoder layer drafting from target features; see the module docstring."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        c = config
        self.config = c
        H, F, D, K = c.hidden_size, c.intermediate_size, c.head_dim, c.draft_vocab_size
        qkv_out = (c.num_heads + 2 * c.num_kv_heads) * D
        init = nnx.initializers.normal(0.02)

        def param(*shape):
            return nnx.Param(init(rngs.params(), shape, dtype))

        self.embed = Frozen(jnp.zeros((c.vocab_size, H), dtype))
        self.d2t = Frozen(jnp.arange(K, dtype=jnp.int32))  # draft id -> target id
        self.t2d = Frozen(target_to_draft(jnp.arange(K), c.vocab_size))  # target id -> draft id, or -1
        if c.kind == "eagle3":
            self.fc = param(H, len(c.feature_layers) * H)
            self.emb_norm = nnx.Param(jnp.ones((H,), dtype))
            self.feat_norm = nnx.Param(jnp.ones((H,), dtype))
            self.attn_norm = None
            self.wqkv = param(qkv_out, 2 * H)
            self.final_norm = nnx.Param(jnp.ones((H,), dtype))
            self.lm_head = param(K, H)
        else:
            self.fc = param(H, 2 * H)
            self.emb_norm = self.feat_norm = None
            self.attn_norm = nnx.Param(jnp.ones((H,), dtype))
            self.wqkv = param(qkv_out, H)
            self.final_norm = Frozen(jnp.ones((H,), dtype))
            self.lm_head = Frozen(jnp.zeros((K, H), dtype))
        self.wo = param(H, c.num_heads * D)
        self.mlp_norm = nnx.Param(jnp.ones((H,), dtype))
        self.w_gate_up = param(2 * F, H)
        self.w_down = param(H, F)

    def init_cache(self, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
        c = self.config
        return KVCache.create(1, batch, capacity, c.num_kv_heads, c.head_dim, dtype)

    def fuse(self, features) -> jax.Array:
        """The step-0 feature [B, T, H] from the target's hidden states at ``feature_layers``."""
        if self.config.kind == "eagle3":
            return linear(jnp.concatenate(features, axis=-1), self.fc[...])
        return features[-1]

    def __call__(self, tokens, feature, positions, cache: KVCache, mask=None, *, num_new=None):
        """Runs T pairs per row against the head's cache.

        Args:
          tokens: int32[B, T], target token ids.
          feature: [B, T, H], the fused target feature or the head's own earlier output.
          positions: int32[B, T], the RoPE positions (a pair's token position).
          cache: a one-layer :class:`KVCache`; row b writes at slots lengths[b] ...
          mask: bool[B, T, S] over cache slots after the write; default causal.
          num_new: int32[B], how many pairs each row commits (default T).

        Returns:
          (hidden [B, T, H], the new cache). ``logits(hidden)`` is the draft distribution's logits.
        """
        c = self.config
        b, t = tokens.shape
        emb = jnp.take(self.embed[...], tokens, axis=0)
        if c.kind == "eagle3":
            residual = feature
            norm_e = rms_norm(emb, self.emb_norm[...], c.rms_eps)
            norm_f = rms_norm(feature, self.feat_norm[...], c.rms_eps)
            u = jnp.concatenate([norm_e, norm_f], axis=-1)
        else:
            residual = linear(jnp.concatenate([emb, feature], axis=-1), self.fc[...])
            u = rms_norm(residual, self.attn_norm[...], c.rms_eps)
        qkv = linear(u, self.wqkv[...])
        qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = apply_rope(qkv[..., :qd].reshape(b, t, c.num_heads, c.head_dim), positions, c.rope_theta)
        k = apply_rope(qkv[..., qd : qd + kvd].reshape(b, t, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
        v = qkv[..., qd + kvd :].reshape(b, t, c.num_kv_heads, c.head_dim)
        if mask is None:
            mask = cache.causal_mask(t)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        slots = cache.lengths[:, None] + jnp.arange(t)[None, :]
        k_all = cache.k[0].at[rows, slots].set(k.astype(cache.k.dtype), mode="drop")
        v_all = cache.v[0].at[rows, slots].set(v.astype(cache.v.dtype), mode="drop")
        x = residual + linear(attention(q, k_all, v_all, mask), self.wo[...])
        gate, up = jnp.split(linear(rms_norm(x, self.mlp_norm[...], c.rms_eps), self.w_gate_up[...]), 2, axis=-1)
        x = x + linear(jax.nn.silu(gate) * up, self.w_down[...])
        num_new = jnp.full((b,), t, jnp.int32) if num_new is None else num_new
        return x, KVCache(k_all[None], v_all[None], cache.lengths).advance(num_new)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Draft-vocabulary logits float32[..., K]."""
        h = rms_norm(hidden, self.final_norm[...], self.config.rms_eps)
        return linear(h, self.lm_head[...]).astype(jnp.float32)

    def attach_target(self, target, d2t) -> None:
        """Copies what the head reads but does not train from a target model: its embedding, the
        vocabulary map and (EAGLE-1) its final norm and output rows. Call before training or drafting."""
        c = self.config
        if target.config.vocab_size != c.vocab_size or target.config.hidden_size != c.hidden_size:
            raise ValueError(
                f"this head was built for vocab {c.vocab_size} x hidden {c.hidden_size}; the target has "
                f"{target.config.vocab_size} x {target.config.hidden_size}."
            )
        d2t = jnp.asarray(d2t, jnp.int32)
        if d2t.shape != (c.draft_vocab_size,):
            raise ValueError(f"the vocabulary map has shape {d2t.shape}; the head wants ({c.draft_vocab_size},).")
        self.embed[...] = target.embed[...]
        self.d2t[...] = d2t
        self.t2d[...] = target_to_draft(d2t, c.vocab_size)
        if c.kind == "eagle1":
            self.copy_target_output(target)

    def copy_target_output(self, target) -> None:
        """The target's final norm and its output rows for the draft vocabulary (after :meth:`attach_target`):
        EAGLE-1 keeps them frozen; an EAGLE-3 head can start from them and train them."""
        self.final_norm[...] = target.final_norm[...]
        self.lm_head[...] = target.output_weights()[self.d2t[...]]

    def warm_start(self, target) -> None:
        """Starts the trained weights from the target's own instead of at random (call after
        :meth:`attach_target`, which sets the draft vocabulary).

        The decoder layer becomes a copy of the target layer that follows the last feature layer
        (EAGLE-1: the top layer), reading the feature half of its input as that layer reads its
        residual stream (the embedding half keeps its random start); the fusion adds the identity
        on the last feature layer's block, so the fused feature starts as that layer's hidden state;
        the output layer and final norm become the target's for the draft vocabulary. The head then
        starts from where the target goes next rather than from noise: with little data it learns
        faster (BENCHMARKS.md, "warm start"). A target with qkv biases keeps only its weights.
        """
        c = self.config
        if target.config.hidden_size != c.hidden_size or target.config.num_layers != c.num_target_layers:
            raise ValueError("warm_start needs the target this head was built for (same hidden size and layers).")
        H = c.hidden_size
        p = target.layer_arrays(min(c.feature_layers[-1] + 1, c.num_target_layers - 1))
        for name in ("wo", "mlp_norm", "w_gate_up", "w_down"):
            getattr(self, name)[...] = p[name]
        fc = self.fc[...]
        if c.kind == "eagle3":
            self.feat_norm[...] = p["attn_norm"]
            self.wqkv[...] = self.wqkv[...].at[:, H:].set(p["wqkv"])
            self.fc[...] = fc.at[:, -H:].add(jnp.eye(H, dtype=fc.dtype))
            self.copy_target_output(target)
        else:  # input [embedding, feature]: the feature's block; norm and output are frozen copies already
            self.attn_norm[...] = p["attn_norm"]
            self.wqkv[...] = p["wqkv"]
            self.fc[...] = fc.at[:, H:].add(jnp.eye(H, dtype=fc.dtype))


def draft_vocabulary(token_counts, size: int) -> np.ndarray:
    """int32[size]: the ``size`` most frequent target ids (ties to the smaller id), most frequent first."""
    counts = np.asarray(token_counts)
    order = np.lexsort((np.arange(len(counts)), -counts))
    return order[:size].astype(np.int32)


def target_to_draft(d2t, vocab_size: int) -> jax.Array:
    """int32[V]: each target id's draft id, or -1 when the draft vocabulary leaves it out."""
    d2t = jnp.asarray(d2t, jnp.int32)
    return jnp.full((vocab_size,), -1, jnp.int32).at[d2t].set(jnp.arange(d2t.shape[0], dtype=jnp.int32))


def ttt_mask(length: int, step: int, num_steps: int | None = None, start=0, window: int | None = None) -> jax.Array:
    """bool[Q, S]: what training-time-test step ``step`` may attend to.

    Keys are laid out step by step: step 0's pairs first (row s at slot s, T slots), then
    each later step j's ``window`` rows (window index i at slot T + (j - 1) * W + i).
    Step 0's queries are the T rows; a later step's are the W rows ``start`` ..
    ``start + W - 1``. A query at row t sees the context (step 0, rows s <= t) and its own
    earlier steps (steps 1..k at its window index), nothing else. Without a window, W = T
    and start = 0. S = T + (num_steps - 1) * W; ``start`` may be traced.
    """
    num_steps = step + 1 if num_steps is None else num_steps
    w = length if window is None else window
    queries = length if step == 0 else w
    rows = jnp.arange(queries)[:, None] + (0 if step == 0 else start)
    slot = jnp.arange(length + (num_steps - 1) * w)[None, :]
    later = slot - length  # (j - 1) * W + i for the slots of steps j >= 1
    own = (later >= 0) & (later // w < step) & (later % w == jnp.arange(queries)[:, None])
    return ((slot < length) & (slot <= rows)) | own


@struct.dataclass
class _EagleState:
    cache: KVCache  # the head's one-layer cache: one pair per committed target token
    logits: jax.Array  # float32[B, K]: the draft distribution's logits for the token after the pending one
    hidden: jax.Array  # [B, H]: the head's output at the last committed pair


@dataclasses.dataclass(frozen=True)
class DynamicTreeSpec:
    """EAGLE-2's knobs (see :func:`jspec.tree.grow_dynamic_tree`): children per expanded node and
    nodes expanded per depth (``top_k``), ``depth``, and nodes kept (``total``, the root included)."""

    top_k: int = 8
    depth: int = 6
    total: int = 48

    def __post_init__(self):
        most = 1 + self.top_k + (self.depth - 1) * self.top_k**2
        if self.top_k < 1 or self.depth < 1 or not 2 <= self.total <= most:
            raise ValueError(
                f"a dynamic tree needs top_k >= 1, depth >= 1 and 2 <= total <= 1 + top_k + (depth - 1) * top_k**2 "
                f"= {most}; got top_k={self.top_k}, depth={self.depth}, total={self.total}."
            )


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    """A drafter over an EAGLE head, no target forward while drafting.

    A chain (``tree=None``): N draft tokens, a ``lax.scan`` over the head. A
    dynamic tree (EAGLE-2): the head expands the best ``top_k`` nodes of each
    depth, attending to its cache and each node's own ancestors, and the best
    ``total`` nodes are verified together (:class:`jspec.drafters.TreeProposal`;
    the children are chosen deterministically, so their rows are one-hot).

    ``weights`` (passed through by the engine) is the head's NNX state, target copies included.
    """

    graphdef: nnx.GraphDef
    num_draft: int
    vocab_size: int
    hidden_layers: tuple[int, ...]
    tree: DynamicTreeSpec | StaticTree | None = None

    @property
    def num_nodes(self) -> int | None:
        if self.tree is None:
            return None
        return self.tree.size if isinstance(self.tree, StaticTree) else self.tree.total

    @classmethod
    def from_head(cls, head: DraftHead, num_draft: int, target_vocab_size: int,
                  tree: DynamicTreeSpec | StaticTree | None = None):  # fmt: skip
        """(drafter, weights); with ``tree`` the depth is the tree's and ``num_draft`` is ignored.

        Raises ValueError when the head was built for another vocabulary.
        """
        if head.config.vocab_size != target_vocab_size:
            raise ValueError(
                f"the head was built for a vocabulary of {head.config.vocab_size}, the target has "
                f"{target_vocab_size}; train or load a head for this target."
            )
        if isinstance(tree, StaticTree):
            _branching(tree)
            num_draft = tree.max_depth
        elif tree is not None:
            num_draft = tree.depth
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1; got {num_draft}.")
        graphdef, weights = nnx.split(head)
        return cls(graphdef, num_draft, target_vocab_size, head.config.feature_layers, tree), weights

    def _pairs(self, head, state_cache, ctx: Context, start, hidden, num_new):
        """Feeds the pairs (feature of token start + j, token start + 1 + j) and reads the output at num_new - 1."""
        t = hidden[0].shape[1]
        cols = start[:, None] + 1 + jnp.arange(t)[None, :]
        tokens = jnp.take_along_axis(ctx.history, jnp.clip(cols, 0, ctx.history.shape[1] - 1), axis=1)
        h, cache = head(tokens, head.fuse(hidden), cols, state_cache.rollback(start), num_new=num_new)
        last = jnp.take_along_axis(h, (num_new - 1)[:, None, None], axis=1)[:, 0]
        return _EagleState(cache, head.logits(last), last)

    def init(self, weights, prompts, ctx: Context, capacity, sampling, hidden):
        head = nnx.merge(self.graphdef, weights)
        b = prompts.shape[0]
        # Prompt pairs: the feature of token t with token t + 1 (the last one is the pending token).
        start = jnp.zeros((b,), jnp.int32)
        extra = _frontier_slots(self.tree)
        return self._pairs(head, head.init_cache(b, capacity + extra), ctx, start, hidden, ctx.cache_length)

    def propose(self, weights, state: _EagleState, ctx: Context, key, sampling: SamplingParams):
        head = nnx.merge(self.graphdef, weights)
        if self.tree is not None:
            return self._propose_tree(head, state, ctx), state
        d2t = head.d2t[...]
        probs0 = probs_from_logits(state.logits, sampling)
        tok0 = sample(jax.random.fold_in(key, 0), probs0)

        def step(carry, i):
            cache, tok, feature = carry
            position = ctx.cache_length + i  # draft i (1-based) sits i tokens after the pending one
            h, cache = head(d2t[tok][:, None], feature[:, None], position[:, None], cache)
            p = probs_from_logits(head.logits(h[:, 0]), sampling)
            nxt = sample(jax.random.fold_in(key, i), p)
            return (cache, nxt, h[:, 0]), (nxt, p)

        _, (toks, probs) = jax.lax.scan(step, (state.cache, tok0, state.hidden), jnp.arange(1, self.num_draft))
        draft = jnp.concatenate([tok0[:, None], jnp.moveaxis(toks, 0, 1)], axis=1)
        probs = jnp.concatenate([probs0[:, None], jnp.moveaxis(probs, 0, 1)], axis=1)  # [B, N, K]
        b, n, _ = probs.shape
        full = jnp.zeros((b, n, self.vocab_size), probs.dtype).at[:, :, d2t].set(probs)
        return Proposal(d2t[draft].astype(jnp.int32), full, jnp.ones((b,), bool)), state

    def _propose_tree(self, head, state: _EagleState, ctx: Context) -> TreeProposal:
        """A dynamic (EAGLE-2) or static tree. Node scores are the head's log-probabilities at
        temperature 1: the children are deterministic, so exactness does not depend on them."""
        tree_spec, d2t = self.tree, head.d2t[...]
        if isinstance(tree_spec, StaticTree):
            branching = _branching(tree_spec)
            sizes = list(tree_spec.fed_per_depth)
        else:
            sizes = [tree_spec.top_k] * (tree_spec.depth - 1)
        width = sum(sizes)  # head cache slots for the fed frontiers, one block per depth
        b = ctx.history.shape[0]
        base = state.cache.lengths
        capacity = state.cache.capacity

        def expand(carry, tokens, parent_slot, d):
            cache, ancestors, h_prev = carry
            f, offset = tokens.shape[1], sum(sizes[: d - 1])
            feature = jnp.take_along_axis(h_prev, parent_slot[:, :, None], axis=1)
            own = jax.nn.one_hot(offset + jnp.arange(f), width, dtype=bool)  # [F, W]
            ancestors = jnp.take_along_axis(ancestors, parent_slot[:, :, None], axis=1) | own[None]
            mask = tree_attention_mask(base, ancestors, capacity)  # committed pairs + own ancestors
            positions = jnp.broadcast_to((ctx.cache_length + d)[:, None], (b, f))
            h, cache = head(d2t[tokens], feature, positions, cache, mask)
            return jax.nn.log_softmax(head.logits(h), axis=-1), (cache, ancestors, h)

        carry = (state.cache, jnp.zeros((b, 1, width), bool), state.hidden[:, None])
        root_logp = jax.nn.log_softmax(state.logits, axis=-1)
        root = jnp.zeros((b,), jnp.int32)
        if isinstance(tree_spec, StaticTree):
            tree, _ = grow_static_tree(expand, carry, root, root_logp, branching)
        else:
            tree, _ = grow_dynamic_tree(expand, carry, root, root_logp, top_k=tree_spec.top_k,
                                        depth=tree_spec.depth, total=tree_spec.total)  # fmt: skip
        t = tree.tokens.shape[1]
        tokens = jnp.where(jnp.arange(t)[None, :] == 0, ctx.last[:, None], d2t[tree.tokens]).astype(jnp.int32)
        used = jnp.ones((b, t), bool)  # probs None: every child is deterministic (one-hot)
        return TreeProposal(tokens, tree.parents, tree.depths, used, None, jnp.ones((b,), bool))

    def commit(self, weights, state: _EagleState, ctx: Context, num_accepted, hidden):
        """The target's features of the pending token and the accepted drafts become committed pairs.

        ``hidden`` covers the forward the engine just ran from the old pending token on (N + 1
        tokens, or 1 for a plain step); ``num_accepted + 1`` of them are now committed.
        """
        head = nnx.merge(self.graphdef, weights)
        n_new = num_accepted + 1
        start = jnp.maximum(ctx.cache_length - n_new, 0)  # the old pending token's position
        return self._pairs(head, state.cache, ctx, start, hidden, n_new)


def _branching(tree: StaticTree) -> list[int]:
    if tree.branching is None:
        raise ValueError("an EAGLE head drafts static trees made by StaticTree.from_branching (e.g. [2, 2, 2]).")
    return list(tree.branching)


def _frontier_slots(tree) -> int:
    """Head cache slots a tree's drafting needs beyond the committed pairs."""
    if tree is None:
        return 0
    if isinstance(tree, StaticTree):
        return sum(tree.fed_per_depth)
    return (tree.depth - 1) * tree.top_k


# ---------------------------------------------------------------------- saving and loading

HEAD_WEIGHTS, HEAD_META = "head.safetensors", "head.json"


def save_head(head: DraftHead, folder, recipe: dict | None = None) -> pathlib.Path:
    """Writes the trained weights (float16: half the bytes) and the vocabulary map to
    ``head.safetensors``, and the config and the recipe that made it to ``head.json``.

    The frozen copies of the target's arrays are not written; :func:`load_head`
    takes them from the target again.
    """
    from safetensors.numpy import save_file

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        ".".join(map(str, path)): np.asarray(v[...], np.float16)
        for path, v in nnx.to_flat_state(nnx.state(head, nnx.Param))
    }
    tensors["d2t"] = np.asarray(head.d2t[...], np.int32)
    tmp = folder / (HEAD_WEIGHTS + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(folder / HEAD_WEIGHTS)
    meta = {"config": json.loads(head.config.to_json()), "recipe": recipe or {}}
    (folder / HEAD_META).write_text(json.dumps(meta, indent=1))
    return folder


def load_head(folder, target) -> DraftHead:
    """A head saved by :func:`save_head`, attached to ``target``; refuses a mismatched or damaged file."""
    from safetensors import safe_open

    folder = pathlib.Path(folder)
    if not (folder / HEAD_META).exists() or not (folder / HEAD_WEIGHTS).exists():
        raise ValueError(f"{folder} does not hold a saved head ({HEAD_META} and {HEAD_WEIGHTS}).")
    config = HeadConfig.from_json(json.dumps(json.loads((folder / HEAD_META).read_text())["config"]))
    head = DraftHead(config, rngs=nnx.Rngs(0))
    try:
        with safe_open(str(folder / HEAD_WEIGHTS), "numpy") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle)
    except Exception as err:  # safetensors raises its own error types on bad files
        raise ValueError(f"{folder / HEAD_WEIGHTS} is corrupt or truncated ({err}); refusing to load it.") from err
    flat = dict(nnx.to_flat_state(nnx.state(head, nnx.Param)))
    for path, var in flat.items():
        name = ".".join(map(str, path))
        if name not in tensors or tensors[name].shape != var.shape:
            raise ValueError(f"{folder / HEAD_WEIGHTS}: tensor {name!r} is missing or has the wrong shape.")
        flat[path] = var.replace(jnp.asarray(tensors[name], jnp.float32))
    nnx.update(head, nnx.from_flat_state(flat))
    head.attach_target(target, tensors["d2t"])
    return head
