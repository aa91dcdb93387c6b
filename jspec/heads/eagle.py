"""EAGLE draft heads: the modules, their configuration, saving and loading.

A head is one decoder layer that drafts from the target's own hidden states
("features") instead of from text alone:

* **EAGLE-3**: the hidden states of a low, a middle and a high target layer
  (default 2, L/2 and L - 3) are fused by a linear 3H -> H. The layer's
  attention reads the normalized token embedding joined to the normalized
  feature (2H -> q, k, v); its residual stream is the feature. A final norm
  and an output layer over a *draft vocabulary* (the K most frequent target
  tokens of the training data) give the draft distribution. After the first
  draft step the head's own output hidden state is the next step's feature,
  which is what training-time test (:mod:`jspec.training.loss`) teaches it.
* **EAGLE-1**: the top layer's hidden state joined to the token embedding, a
  linear 2H -> H, a plain decoder layer that predicts the next top-layer
  feature, and the target's own final norm and output layer (frozen copies,
  restricted to the draft vocabulary).

The drafter that runs a head is :class:`jspec.drafters.EagleDrafter`.

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
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jspec.core.cache import KVCache
from jspec.files import atomic_write, write_text
from jspec.models.config import RopeScaling
from jspec.models.layers import decoder_layer, linear, rms_norm

__all__ = [
    "KINDS", "DraftHead", "Frozen", "HeadConfig", "draft_vocabulary", "load_head", "save_head", "target_to_draft",
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
    feature_layers: tuple[int, ...]  # the target layers whose *output* the head reads, low to high
    num_target_layers: int
    # How published heads compute (jspec.heads.formats sets them; the defaults are jspec's own heads).
    target_hidden_size: int = 0  # the target's width when it differs from the head's (0: the same)
    fc_bias: bool = False  # the fusion has a bias (SafeAILab's EAGLE-1)
    fc_norm: bool = False  # an RMSNorm on each feature before the fusion (SpecForge, speculators)
    attn_norm: bool = True  # EAGLE-1: an RMSNorm before attention (SafeAILab's layer 0 has none)
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (a Qwen3-type layer)
    norm_before_residual: bool = False  # EAGLE-3: the residual stream starts from the normalized feature
    logits_norm: bool = True  # the final norm before the output layer (SafeAILab's EAGLE-1: none)
    feedback_norm: bool = False  # the next draft step reads the normalized output (speculators' norm_output)
    feature_norm: bool = False  # EAGLE-1: the feature is the target's final-normalized top state
    own_embed: bool = False  # the head's own token embedding, not the target's
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        if self.target_hidden_size == 0:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        if self.target_hidden_size != self.hidden_size and not self.own_embed:
            raise ValueError("a head narrower or wider than its target needs its own embedding (own_embed).")

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
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"head config field(s) {unknown} are not ones this jspec implements; refusing the head.")
        rope = d.get("rope_scaling")
        return cls(**(d | {"feature_layers": tuple(d["feature_layers"]),
                           "rope_scaling": None if rope is None else RopeScaling(**rope)}))  # fmt: skip

    def inv_freq(self) -> np.ndarray:
        """float32[D/2]: the head's own RoPE frequencies (its theta and scaling, not the target's)."""
        exponent = np.arange(0, self.head_dim, 2).astype(np.float32) / np.float32(self.head_dim)
        inv = (np.float32(1.0) / np.float32(self.rope_theta) ** exponent).astype(np.float32)
        return inv if self.rope_scaling is None else self.rope_scaling.apply(inv).astype(np.float32)


class DraftHead(nnx.Module):
    """One decoder layer drafting from target features; see the module docstring."""

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs | None, dtype=jnp.float32):
        """``rngs=None`` leaves the matrices at zero, for a head whose weights are read next (drawing
        random ones would compile and run an initializer per shape, for nothing)."""
        c = config
        self.config = c
        H, F, D, K = c.hidden_size, c.intermediate_size, c.head_dim, c.draft_vocab_size
        qkv_out = (c.num_heads + 2 * c.num_kv_heads) * D
        init = nnx.initializers.normal(0.02)

        def param(*shape):
            if rngs is None:
                return nnx.Param(jax.device_put(np.zeros(shape, dtype)))
            return nnx.Param(init(rngs.params(), shape, dtype))

        Ht, n = c.target_hidden_size, len(c.feature_layers)
        self.embed = Frozen(jnp.zeros((c.vocab_size, H), dtype))
        self.d2t = Frozen(jnp.arange(K, dtype=jnp.int32))  # draft id -> target id
        self.t2d = Frozen(target_to_draft(jnp.arange(K), c.vocab_size))  # target id -> draft id, or -1
        self.fc_b = nnx.Param(jnp.zeros((H,), dtype)) if c.fc_bias else None
        self.fc_norms = nnx.Param(jnp.ones((n, Ht), dtype)) if c.fc_norm else None
        self.bqkv = nnx.Param(jnp.zeros((qkv_out,), dtype)) if c.qkv_bias else None
        self.q_norm, self.k_norm = (nnx.Param(jnp.ones((D,), dtype)) for _ in range(2)) if c.qk_norm else (None, None)
        if c.kind == "eagle3":
            self.fc = param(H, n * Ht)
            self.emb_norm = nnx.Param(jnp.ones((H,), dtype))
            self.feat_norm = nnx.Param(jnp.ones((H,), dtype))
            self.attn_norm = None
            self.wqkv = param(qkv_out, 2 * H)
            self.final_norm = nnx.Param(jnp.ones((H,), dtype))
            self.lm_head = param(K, H)
        else:
            self.fc = param(H, 2 * H)
            self.emb_norm = self.feat_norm = None
            self.attn_norm = nnx.Param(jnp.ones((H,), dtype)) if c.attn_norm else None
            self.wqkv = param(qkv_out, H)
            self.final_norm = Frozen(jnp.ones((H,), dtype))
            self.lm_head = Frozen(jnp.zeros((K, H), dtype))
        self.wo = param(H, c.num_heads * D)
        self.mlp_norm = nnx.Param(jnp.ones((H,), dtype))
        self.w_gate_up = param(2 * F, H)
        self.w_down = param(H, F)

    def init_cache(self, batch: int, capacity: int, dtype=None) -> KVCache:
        """An empty one-layer cache; its dtype defaults to the head's weights'."""
        c = self.config
        dtype = self.wo[...].dtype if dtype is None else dtype
        return KVCache.create(1, batch, capacity, c.num_kv_heads, c.head_dim, dtype)

    def fuse(self, features) -> jax.Array:
        """The step-0 feature [B, T, H] from the target's hidden states at ``feature_layers``."""
        c = self.config
        if c.kind == "eagle3":
            if c.fc_norm:
                features = [rms_norm(f, w, c.rms_eps) for f, w in zip(features, self.fc_norms[...], strict=True)]
            return linear(jnp.concatenate(features, axis=-1), self.fc[...])
        if c.feature_norm:  # the target's final norm (a frozen copy) over its top layer
            return rms_norm(features[-1], self.final_norm[...], c.rms_eps)
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
        names = ("wqkv", "bqkv", "q_norm", "k_norm", "wo", "mlp_norm", "w_gate_up", "w_down")
        p = {name: getattr(self, name)[...] for name in names if getattr(self, name) is not None}
        if c.kind == "eagle3":  # the residual stream is the feature; attention reads [embedding, feature]
            norm_e = rms_norm(emb, self.emb_norm[...], c.rms_eps)
            norm_f = rms_norm(feature, self.feat_norm[...], c.rms_eps)
            x = norm_f if c.norm_before_residual else feature
            attn_input = jnp.concatenate([norm_e, norm_f], axis=-1)
        else:  # EAGLE-1: a plain layer over the fused [embedding, feature]
            x = linear(jnp.concatenate([emb, feature], axis=-1), self.fc[...])
            x = x + self.fc_b[...].reshape(1, 1, -1) if c.fc_bias else x
            if c.attn_norm:
                p["attn_norm"], attn_input = self.attn_norm[...], None
            else:
                attn_input = x
        if mask is None:
            mask = cache.causal_mask(t)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        slots = cache.lengths[:, None] + jnp.arange(t)[None, :]
        written = {}

        def write(k, v):
            written["k"] = cache.k[0].at[rows, slots].set(k.astype(cache.k.dtype), mode="drop")
            written["v"] = cache.v[0].at[rows, slots].set(v.astype(cache.v.dtype), mode="drop")
            return written["k"], written["v"]

        inv_freq = None if c.rope_scaling is None else jnp.asarray(c.inv_freq())  # None: from rope_theta, as targets
        x = decoder_layer(c, p, x, write, positions, mask, attn_input, inv_freq=inv_freq)
        if c.feedback_norm:  # the normalized output is both the next step's feature and the logits' input
            x = rms_norm(x, self.final_norm[...], c.rms_eps)
        num_new = jnp.full((b,), t, jnp.int32) if num_new is None else num_new
        return x, KVCache(written["k"][None], written["v"][None], cache.lengths).advance(num_new)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Draft-vocabulary logits float32[..., K]."""
        c = self.config
        h = rms_norm(hidden, self.final_norm[...], c.rms_eps) if c.logits_norm and not c.feedback_norm else hidden
        return linear(h, self.lm_head[...]).astype(jnp.float32)

    def attach_target(self, target, d2t) -> None:
        """Copies what the head reads but does not train from a target model: its embedding, the
        vocabulary map and (EAGLE-1) its final norm and output rows. Call before training or drafting."""
        c = self.config
        if target.config.vocab_size != c.vocab_size or target.config.hidden_size != c.target_hidden_size:
            raise ValueError(
                f"this head was built for vocab {c.vocab_size} x hidden {c.target_hidden_size}; the target has "
                f"{target.config.vocab_size} x {target.config.hidden_size}."
            )
        d2t = jnp.asarray(d2t, jnp.int32)
        if d2t.shape != (c.draft_vocab_size,):
            raise ValueError(f"the vocabulary map has shape {d2t.shape}; the head wants ({c.draft_vocab_size},).")
        if not c.own_embed:
            self.embed[...] = target.embed[...]
        self.d2t[...] = d2t
        self.t2d[...] = target_to_draft(d2t, c.vocab_size)
        if c.kind == "eagle1":
            self.copy_target_output(target)

    def copy_target_output(self, target) -> None:
        """The target's final norm and its output rows for the draft vocabulary (after :meth:`attach_target`):
        EAGLE-1 keeps them frozen; an EAGLE-3 head can start from them and train them."""
        self.final_norm[...] = target.final_norm_weight()
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
        faster (measured: docs/log, "warm start"). A target with qkv biases keeps only its weights; from a
        target with query/key norms, sandwich norms or GeGLU (Qwen3, Gemma 3) the copy is only a start.
        """
        c = self.config
        if target.config.hidden_size != c.hidden_size or target.config.num_layers != c.num_target_layers:
            raise ValueError("warm_start needs the target this head was built for (same hidden size and layers).")
        H = c.hidden_size
        p = target.layer_arrays(min(c.feature_layers[-1] + 1, c.num_target_layers - 1))
        offset = target.config.norm_offset  # the head's norms are plain RMSNorms; Gemma's multiply by 1 + w
        p = p | {name: p[name] + offset for name in ("attn_norm", "mlp_norm")}
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


# ---------------------------------------------------------------------- saving and loading

HEAD_WEIGHTS, HEAD_META = "head.safetensors", "head.json"


def save_head(head: DraftHead, folder, recipe: dict | None = None) -> pathlib.Path:
    """Writes the trained weights (float16: half the bytes) and the vocabulary map to
    ``head.safetensors``, and the config and the recipe that made it to ``head.json``.

    The frozen copies of the target's arrays are not written; :func:`load_head`
    takes them from the target again.
    """

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        ".".join(map(str, path)): np.asarray(v[...], np.float16)
        for path, v in nnx.to_flat_state(nnx.state(head, nnx.Param))
    }
    tensors["d2t"] = np.asarray(head.d2t[...], np.int32)
    if head.config.own_embed:  # not the target's: it travels with the head
        tensors["embed"] = np.asarray(head.embed[...], np.float16)
    with atomic_write(folder / HEAD_WEIGHTS) as tmp:
        save_file(tensors, str(tmp))
    meta = {"config": json.loads(head.config.to_json()), "recipe": recipe or {}}
    write_text(folder / HEAD_META, json.dumps(meta, indent=1))
    return folder


def read_tensors(path: pathlib.Path) -> dict:
    """Every tensor of a head's safetensors file (numpy); a damaged file is refused, naming it."""

    try:
        with safe_open(str(path), "numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle)
    except Exception as err:  # safetensors raises its own error types on bad files
        raise ValueError(f"{path} is corrupt or truncated ({err}); refusing to load it.") from err


def load_head(folder, target) -> DraftHead:
    """A head saved by :func:`save_head`, attached to ``target``; refuses a mismatched or damaged file."""

    folder = pathlib.Path(folder)
    if not (folder / HEAD_META).exists() or not (folder / HEAD_WEIGHTS).exists():
        raise ValueError(f"{folder} does not hold a saved head ({HEAD_META} and {HEAD_WEIGHTS}).")
    config = HeadConfig.from_json(json.dumps(json.loads((folder / HEAD_META).read_text())["config"]))
    head = DraftHead(config, rngs=None)
    tensors = read_tensors(folder / HEAD_WEIGHTS)
    flat = dict(nnx.to_flat_state(nnx.state(head, nnx.Param)))
    for path, var in flat.items():
        name = ".".join(map(str, path))
        if name not in tensors or tensors[name].shape != var.shape:
            raise ValueError(f"{folder / HEAD_WEIGHTS}: tensor {name!r} is missing or has the wrong shape.")
        flat[path] = var.replace(jnp.asarray(tensors[name], jnp.float32))
    nnx.update(head, nnx.from_flat_state(flat))
    head.attach_target(target, tensors["d2t"])
    if config.own_embed:
        head.embed[...] = jnp.asarray(tensors["embed"], jnp.float32)
    return head
