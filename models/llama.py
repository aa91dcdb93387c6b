"""The decoder families in Flax NNX: Llama layout (Llama 2/3.x, SmolLM2), Qwen2, Qwen3 and Gemma 3 (text).

Grouped-query attention, RMSNorm, a gated MLP (SwiGLU or GeGLU), half-split (NeoX) rotary
embeddings; the switches of :class:`~jspec.models.config.ModelConfig` add what a family has
beyond that (QKV bias, query/key norms, (1 + w) and sandwich norms, a scaled embedding,
sliding-window layers with their own RoPE base, RoPE scaling). The layer weights are stacked
along a leading L axis, so the same parameters serve an unrolled Python loop over layers and a
``lax.scan``; which one runs is chosen per backend in :func:`layer_loop_for_backend`, the only
place that knows.

The KV cache is not part of the module: :meth:`Transformer.__call__` takes a
:class:`jspec.core.cache.KVCache` and returns the new one.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jspec.core.cache import KVCache
from jspec.models.config import ModelConfig
from jspec.models.layers import (
    attention_and_mlp_traced_once,
    attention_inputs_traced_once,
    decoder_layer,
    linear,
    rms_norm,
)

__all__ = ["ModelOutput", "Transformer", "layer_loop_for_backend"]

LAYER_PARAMS = (
    "attn_norm", "wqkv", "bqkv", "wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm", "wo", "post_attn_norm",
    "mlp_norm", "w_gate_up", "w_gate", "w_up", "w_down", "post_mlp_norm",
)  # fmt: skip
# Matrices are stored [out, in] (the checkpoints' layout) and applied by :func:`linear`.
# Fused weights and the checkpoint tensors they concatenate (along the output axis, 0):
# one matmul instead of three (or two) halves the ops per layer, which is what
# a batch-1 decode step on CPU spends its time on besides reading weights. A model
# split over heads holds the parts (:meth:`Transformer.unfused`).
FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def layer_loop_for_backend(backend: str | None = None) -> str:
    """ "unrolled" or "scan": the faster way to run the layers on this backend.

    On XLA CPU the unrolled loop measured 1.5-3x faster per decode step (scan
    slices each layer's weights out of the stack every step); on accelerators
    scan compiles much faster and runs as fast.
    ``JSPEC_LAYER_LOOP=scan|unrolled`` overrides the choice (what ``experiments/benchmarks/startup.py`` measures).
    """
    chosen = os.environ.get("JSPEC_LAYER_LOOP", "").strip()
    if chosen:
        if chosen not in ("unrolled", "scan"):
            raise ValueError(f"JSPEC_LAYER_LOOP must be 'unrolled' or 'scan'; got {chosen!r}.")
        return chosen
    backend = backend or jax.default_backend()
    return "unrolled" if backend == "cpu" else "scan"


@struct.dataclass
class ModelOutput:
    """Attributes:
    logits: float32[B, T, V] (or [B, 1, V] with ``logit_index``).
    hidden_states: tuple of float32[B, T, H], the residual stream after each
      layer named in ``hidden_layers``, in that order.
    cache: the new :class:`KVCache`.
    """

    logits: jax.Array
    hidden_states: tuple
    cache: KVCache


class LayerWeights(nnx.Module):
    """One layer's weights, or all layers' stacked along a leading L axis (``stack=L``); with
    ``fused=False`` q, k, v and gate, up are separate matrices (see :data:`FUSED`)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype, stack: int | None = None, fused: bool = True):
        c = config
        lead = () if stack is None else (stack,)
        init = nnx.initializers.normal(0.02)
        H, F, D = c.hidden_size, c.intermediate_size, c.head_dim
        qd, kvd = c.num_heads * D, c.num_kv_heads * D

        def param(*shape):
            return nnx.Param(init(rngs.params(), lead + shape, dtype))

        def norm(size):  # the identity: weight 1, or 0 where the norm multiplies by (1 + w)
            return nnx.Param(jnp.full((*lead, size), 1.0 - c.norm_offset, dtype))

        self.attn_norm = norm(H)
        outs = {"wq": qd, "wk": kvd, "wv": kvd}
        self.wqkv = param(qd + 2 * kvd, H) if fused else None
        self.bqkv = param(qd + 2 * kvd) if c.qkv_bias and fused else None
        for name, out in outs.items():
            setattr(self, name, None if fused else param(out, H))
            setattr(self, "b" + name[1], param(out) if c.qkv_bias and not fused else None)
        self.q_norm, self.k_norm = (norm(D), norm(D)) if c.qk_norm else (None, None)
        self.wo = param(H, qd)
        self.post_attn_norm = norm(H) if c.post_norms else None
        self.mlp_norm = norm(H)
        self.w_gate_up = param(2 * F, H) if fused else None
        self.w_gate, self.w_up = (None, None) if fused else (param(F, H), param(F, H))
        self.w_down = param(H, F)
        self.post_mlp_norm = norm(H) if c.post_norms else None

    def arrays(self) -> dict:
        return {name: getattr(self, name)[...] for name in LAYER_PARAMS if getattr(self, name) is not None}


class Transformer(nnx.Module):
    """A decoder-only transformer of the Llama family.

    With ``layer_loop="unrolled"`` each layer keeps its own arrays (slicing a
    stacked weight inside jit copies it on XLA CPU, which cost 10x per decode
    step); with ``"scan"`` the layers are stacked along a leading L axis.
    """

    def __init__(
        self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, layer_loop: str | None = None, fused=True
    ):
        c = config
        self.config, self.fused = c, fused
        self.layer_loop = layer_loop or layer_loop_for_backend()
        if self.layer_loop not in ("unrolled", "scan"):
            raise ValueError(f"layer_loop must be 'unrolled' or 'scan'; got {self.layer_loop!r}.")
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Param(init(rngs.params(), (c.vocab_size, c.hidden_size), dtype))
        if self.layer_loop == "scan":
            self.layers = LayerWeights(c, rngs, dtype, stack=c.num_layers, fused=fused)
        else:
            self.layers = nnx.List([LayerWeights(c, rngs, dtype, fused=fused) for _ in range(c.num_layers)])
        self.final_norm = nnx.Param(jnp.full((c.hidden_size,), 1.0 - c.norm_offset, dtype))
        self.lm_head = (
            None if c.tie_embeddings else nnx.Param(init(rngs.params(), (c.vocab_size, c.hidden_size), dtype))
        )

    # ------------------------------------------------------------------ pieces

    def unfused(self) -> Transformer:
        """This model with q, k, v and gate, up as separate matrices (itself when they are): what a
        model split over heads holds, so that a device's slice of each is whole heads or MLP columns."""
        if not self.fused:
            return self
        c = self.config
        qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        cuts = {"wqkv": [qd, qd + kvd], "bqkv": [qd, qd + kvd], "w_gate_up": [c.intermediate_size]}
        dtype = self.embed[...].dtype
        abstract = nnx.eval_shape(
            lambda: Transformer(c, rngs=nnx.Rngs(0), dtype=dtype, layer_loop=self.layer_loop, fused=False)
        )
        graphdef, state = nnx.split(abstract)
        source = dict(nnx.to_flat_state(nnx.state(self)))
        flat = dict(nnx.to_flat_state(state))
        for path, var in flat.items():
            whole = next((f for f, parts in FUSED.items() if path[-1] in parts), None)
            if whole is None:
                value = source[path][...]
            else:
                fused_value = source[(*path[:-1], whole)][...]
                axis = fused_value.ndim - (1 if whole == "bqkv" else 2)  # the output axis
                value = jnp.split(fused_value, cuts[whole], axis=axis)[FUSED[whole].index(path[-1])]
            flat[path] = var.replace(value)
        return nnx.merge(graphdef, nnx.from_flat_state(flat))

    def layer_arrays(self, index: int) -> dict:
        """Layer ``index``'s weights by name (:data:`LAYER_PARAMS`), whichever layer loop holds them."""
        if not 0 <= index < self.config.num_layers:
            raise ValueError(f"layer {index} out of range for a {self.config.num_layers}-layer model.")
        if self.layer_loop == "scan":
            return {name: w[index] for name, w in self.layers.arrays().items()}
        return self.layers[index].arrays()

    def output_weights(self) -> jax.Array:
        """float[V, H]: the output layer (the embedding when tied)."""
        return (self.embed if self.lm_head is None else self.lm_head)[...]

    def final_norm_weight(self) -> jax.Array:
        """float[H]: the final norm as a plain RMSNorm weight (Gemma's 1 + w), for heads and losses."""
        return self.final_norm[...] + self.config.norm_offset

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm and output layer: [..., H] → float32[..., V]."""
        h = rms_norm(hidden, self.final_norm[...], self.config.rms_eps, self.config.norm_offset)
        return linear(h, self.output_weights()).astype(jnp.float32)

    # ------------------------------------------------------------------ forward

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        mask: jax.Array | None = None,
        *,
        num_new: jax.Array | None = None,
        hidden_layers: tuple[int, ...] = (),
        logit_index: jax.Array | None = None,
    ) -> ModelOutput:
        """Runs T new tokens per row against the cache.

        Args:
          tokens: int32[B, T].
          positions: int32[B, T], the RoPE positions.
          cache: the cache; row b's new entries go to slots lengths[b] .. + T.
          mask: bool[B, T, S] over cache slots (after the write); None means
            causal: committed slots plus new tokens up to and including t.
          num_new: int32[B], how many of the T tokens each row commits (for
            right-padded prompts); default T. Becomes part of the new lengths.
          hidden_layers: layers whose output residual stream to return (static).
          logit_index: int32[B]; when given, logits only at that token of each
            row ([B, 1, V]), which saves the output layer's cost in prefill.

        Returns:
          A :class:`ModelOutput`.
        """
        c = self.config
        b, t = tokens.shape
        for layer in hidden_layers:
            if not 0 <= layer < c.num_layers:
                raise ValueError(f"hidden layer {layer} out of range for a {c.num_layers}-layer model.")
        if mask is None:
            mask = cache.causal_mask(t)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        slots = cache.lengths[:, None] + jnp.arange(t)[None, :]
        x = jnp.take(self.embed[...], tokens, axis=0)
        if c.embed_scale:  # Gemma: the scale rounded to the weights' dtype, as the reference does
            x = x * jnp.asarray(c.hidden_size**0.5, x.dtype)
        local_mask = self.sliding_mask(mask, positions, cache.lengths) if c.layer_types else mask

        if self.layer_loop == "scan":
            freqs = jnp.stack([c.inv_freq(i) for i in range(c.num_layers)])
            sliding = jnp.array([c.is_sliding(i) for i in range(c.num_layers)])

            def body(x, xs):
                p, k_layer, v_layer, inv_freq, is_sliding = xs
                written = {}

                def write(k, v):
                    # Each row writes at its own slots; out-of-range slots are dropped, never clamped.
                    written["k"] = k_layer.at[rows, slots].set(k.astype(k_layer.dtype), mode="drop")
                    written["v"] = v_layer.at[rows, slots].set(v.astype(v_layer.dtype), mode="drop")
                    return written["k"], written["v"]

                layer_mask = jnp.where(is_sliding, local_mask, mask) if c.layer_types else mask
                # The carry keeps its dtype even where a cache of another dtype promotes the attention.
                x = decoder_layer(c, p, x, write, positions, layer_mask, inv_freq=inv_freq).astype(x.dtype)
                return x, (written["k"], written["v"], x if hidden_layers else None)

            xs = (self.layers.arrays(), cache.k, cache.v, freqs, sliding)
            x, (new_k, new_v, all_hidden) = jax.lax.scan(body, x, xs)
            hidden = tuple(all_hidden[i] for i in hidden_layers)
        else:
            buf, outs = {"k": cache.k, "v": cache.v}, {}
            for i, layer in enumerate(self.layers):

                def write(k, v, i=i):
                    # Writes only the new entries into the whole cache, then reads the
                    # layer back: write-before-read lets XLA update the buffer in place.
                    buf["k"] = buf["k"].at[i, rows, slots].set(k.astype(buf["k"].dtype), mode="drop")
                    buf["v"] = buf["v"].at[i, rows, slots].set(v.astype(buf["v"].dtype), mode="drop")
                    return buf["k"][i], buf["v"][i]

                layer_mask = local_mask if c.is_sliding(i) else mask
                p = layer.arrays()  # decoder_layer, with each half traced once for all layers
                q, k, v = attention_inputs_traced_once(c, p, x, positions, None, c.inv_freq(i))
                k_all, v_all = write(k, v)
                x = attention_and_mlp_traced_once(c, p, x, q, k_all, v_all, layer_mask)
                outs[i] = x
            new_k, new_v = buf["k"], buf["v"]
            hidden = tuple(outs[i] for i in hidden_layers)

        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index.astype(jnp.int32)[:, None, None], axis=1)
        num_new = jnp.full((b,), t, jnp.int32) if num_new is None else num_new
        new_cache = KVCache(new_k, new_v, cache.lengths).advance(num_new)
        return ModelOutput(logits=self.logits(x), hidden_states=hidden, cache=new_cache)

    def sliding_mask(self, mask: jax.Array, positions: jax.Array, lengths: jax.Array) -> jax.Array:
        """``mask`` [B, T, S] narrowed to the sliding window: a query at position p sees keys at
        positions above p - W. Committed slot s holds position s; the T new tokens sit at slots
        lengths .. lengths + T with their own ``positions`` (a tree's nodes share depths)."""
        s = mask.shape[-1]
        slot = jnp.arange(s)[None, :]
        new = jnp.clip(slot - lengths[:, None], 0, positions.shape[1] - 1)
        key_pos = jnp.where(slot < lengths[:, None], slot, jnp.take_along_axis(positions, new, axis=1))
        return mask & (key_pos[:, None, :] > positions[:, :, None] - self.config.sliding_window)

    def init_cache(self, batch: int, capacity: int, dtype=None) -> KVCache:
        """An empty cache; its dtype defaults to the weights' (a bfloat16 model keeps a bfloat16 residual)."""
        c = self.config
        dtype = self.embed[...].dtype if dtype is None else dtype
        return KVCache.create(c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim, dtype)
