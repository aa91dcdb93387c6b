"""The layer math shared by the model families and the draft heads: the weight-left matmul, RMSNorm,
half-split RoPE, grouped-query attention and the decoder layer.

A decoder layer is two halves around its cache write (:func:`attention_inputs`, then the write, then
:func:`attention_and_mlp`); :class:`~jspec.models.llama.Transformer`'s unrolled loop calls the halves jitted,
so that its layers are traced once (below).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "apply_rope", "attention", "attention_and_mlp", "attention_inputs", "decoder_layer", "linear", "rms_norm",
    "rope_inv_freq",
]  # fmt: skip


def _expand(w: jax.Array, ndim: int) -> jax.Array:
    """Adds leading axes so w broadcasts against an ndim array (explicit, rank promotion off)."""
    return w.reshape((1,) * (ndim - w.ndim) + w.shape)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] times w [out, in] -> [..., out], with the weight as the left operand of the dot.

    The weight on the left, contracted along its contiguous axis, is the layout XLA CPU ran
    fastest for a forward over a few tokens (a verify step) and for the matrix-vector products
    of decoding (docs/log, "weight layout [out, in]").
    """
    out = jax.lax.dot_general(w, x, (((1,), (x.ndim - 1,)), ((), ())))  # [out, ...]
    return jnp.moveaxis(out, 0, -1)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm times ``weight`` (Llama, Qwen) or, with ``offset=1``, times ``1 + weight`` in float32 (Gemma)."""
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    if not offset:
        return x * jax.lax.rsqrt(var + eps) * _expand(weight, x.ndim)
    normed = x.astype(jnp.float32) * jax.lax.rsqrt(var.astype(jnp.float32) + eps)
    return (normed * (offset + _expand(weight, x.ndim).astype(jnp.float32))).astype(x.dtype)


def rope_inv_freq(theta: float, head_dim: int) -> jax.Array:
    """float32[D/2]: unscaled RoPE inverse frequencies."""
    return theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Half-split (NeoX) rotary embedding. x: [B, T, heads, D], positions: int[B, T], inv_freq: [D/2]."""
    d = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)[None, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float | None = None) -> jax.Array:
    """Grouped-query attention over cache slots.

    Args:
      q: [B, T, heads, D]; k, v: [B, S, kv heads, D]; mask: bool[B, T, S].
      scale: the query scaling; default D ** -0.5.

    Returns:
      [B, T, heads * D].
    """
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * (d**-0.5 if scale is None else scale)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(b, t, heads * d)


def decoder_layer(config, p: dict, x, write, positions, mask, attn_input=None, inv_freq=None):
    """One decoder layer: attention over the cache, then the gated MLP, each added to the residual stream.

    Shared by the target models and the EAGLE draft heads, which read their attention input
    from more than the residual stream.

    Args:
      config: the attention shapes (``num_heads``, ``num_kv_heads``, ``head_dim``,
        ``rope_theta``, ``rms_eps``) and, when present, the family's switches (``qkv_bias``,
        ``qk_norm``, ``norm_offset``, ``post_norms``, ``activation``, ``query_scale``).
      p: the layer's weights by name (:data:`~jspec.models.llama.LAYER_PARAMS`; ``attn_norm`` and ``bqkv`` may
        be absent when ``attn_input`` is given or there is no bias).
      x: [B, T, H], the residual stream.
      write: stores this step's keys and values [B, T, KVH, D] in the cache and returns
        the layer's whole cache (k, v) [B, S, KVH, D].
      positions: int32[B, T], the RoPE positions; mask: bool[B, T, S].
      attn_input: [B, T, H'] that the q, k, v projection reads instead of
        ``rms_norm(x, attn_norm)`` (an EAGLE-3 head's normalized embedding and feature).
      inv_freq: float32[D/2], this layer's RoPE frequencies; default from ``rope_theta``.

    Returns:
      The new residual stream [B, T, H].
    """
    q, k, v = attention_inputs(config, p, x, positions, attn_input, inv_freq)
    k_all, v_all = write(k, v)
    return attention_and_mlp(config, p, x, q, k_all, v_all, mask)


def _norm(c, p: dict, v, name: str):
    return rms_norm(v, p[name], c.rms_eps, getattr(c, "norm_offset", 0.0))


def attention_inputs(config, p: dict, x, positions, attn_input=None, inv_freq=None):
    """A layer's first half (:func:`decoder_layer`'s arguments): the rotated queries and keys and the values,
    [B, T, heads or kv heads, D], before the cache write."""
    c = config
    b, t, _ = x.shape
    h = _norm(c, p, x, "attn_norm") if attn_input is None else attn_input
    bias = getattr(c, "qkv_bias", False)
    if "wqkv" in p:
        qkv = linear(h, p["wqkv"]) + (_expand(p["bqkv"], 3) if bias else 0)
        qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv[..., :qd], qkv[..., qd : qd + kvd], qkv[..., qd + kvd :]
    else:  # the parts (a model split over heads)
        q, k, v = (linear(h, p["w" + n]) + (_expand(p["b" + n], 3) if bias else 0) for n in "qkv")
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if getattr(c, "qk_norm", False):
        q, k = _norm(c, p, q, "q_norm"), _norm(c, p, k, "k_norm")
    inv_freq = rope_inv_freq(c.rope_theta, c.head_dim) if inv_freq is None else inv_freq
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def attention_and_mlp(config, p: dict, x, q, k_all, v_all, mask):
    """A layer's second half: attention over the layer's whole cache ``k_all``, ``v_all`` [B, S, KVH, D],
    then the gated MLP, each added to the residual stream ``x``; returns the new stream."""
    c = config

    def norm(v, name):
        return _norm(c, p, v, name)

    out = linear(attention(q, k_all, v_all, mask, getattr(c, "query_scale", None)), p["wo"])
    post = getattr(c, "post_norms", False)
    x = x + (norm(out, "post_attn_norm") if post else out)

    h = norm(x, "mlp_norm")
    gate, up = jnp.split(linear(h, p["w_gate_up"]), 2, axis=-1) if "w_gate_up" in p else (
        linear(h, p["w_gate"]), linear(h, p["w_up"]))  # fmt: skip
    act = jax.nn.gelu(gate, approximate=True) if getattr(c, "activation", "silu") == "gelu_tanh" else jax.nn.silu(gate)
    out = linear(act * up, p["w_down"])
    return x + (norm(out, "post_mlp_norm") if post else out)


# The unrolled loop calls each half of a layer as a jitted function. jax traces a jitted function once
# per configuration and argument shapes, so a forward's layers cost one layer's tracing, not one each
# (a warm start is mostly tracing and loading the cached program); XLA inlines the calls, and the
# program runs as fast (docs/log/2026-12.md, "a layer traced once").
attention_inputs_traced_once = jax.jit(attention_inputs, static_argnums=0)
attention_and_mlp_traced_once = jax.jit(attention_and_mlp, static_argnums=0)
