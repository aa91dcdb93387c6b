"""An immutable KV cache: arrays outside the modules plus a logical length per row.

Keys and values live in float arrays [L, B, S, KVH, D] (layers, batch, cache
slots, kv heads, head dim); ``lengths`` (int32[B]) says how many slots of each
row are committed. A forward writes row b's new entries at slots
``lengths[b] ..``; attention masks slots by logical length, so rolling back
rejected tokens is only a change of ``lengths``. Under ``jit`` with the cache
donated, XLA updates the buffers in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jspec.loop.sharding import DATA, MODEL, constrain

__all__ = ["KVCache"]


@struct.dataclass
class KVCache:
    """Attributes:
    k: float[L, B, S, KVH, D].
    v: float[L, B, S, KVH, D].
    lengths: int32[B], committed slots per row.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers, batch, capacity, num_kv_heads, head_dim, dtype=jnp.float32) -> KVCache:
        if capacity < 1 or batch < 1:
            raise ValueError(f"cache needs batch >= 1 and capacity >= 1; got {batch} and {capacity}.")
        shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
        axes = (None, DATA, None, MODEL, None)  # rows and KV heads split over a mesh (jspec.loop.sharding)
        k, v = (constrain(jnp.zeros(shape, dtype), axes) for _ in "kv")
        return cls(k, v, constrain(jnp.zeros((batch,), jnp.int32), (DATA,)))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def rollback(self, lengths: jax.Array) -> KVCache:
        """Sets each row's logical length; slots past it are ignored and later overwritten."""
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def advance(self, num_new: jax.Array) -> KVCache:
        return dataclasses.replace(self, lengths=self.lengths + jnp.asarray(num_new, jnp.int32))

    def commit_path(self, start: jax.Array, path: jax.Array, num_new: jax.Array) -> KVCache:
        """Moves each row's accepted tree path into contiguous slots and commits it.

        The entries a tree forward wrote at slots ``start + path[b, i]`` move to
        ``start + i`` (``path[b, i] >= i``: nodes only move down), and row b's
        length becomes ``start + num_new``.

        Args:
          start: int32[B], the slot of each row's tree root.
          path: int32[B, P], node indices of the accepted path from the root.
          num_new: int32[B], how many path entries each row keeps.
        """
        b, p = path.shape
        rows = jnp.arange(b)[:, None]
        src = start[:, None] + path
        dst = start[:, None] + jnp.arange(p)[None, :]
        k = self.k.at[:, rows, dst].set(self.k[:, rows, src], mode="drop")
        v = self.v.at[:, rows, dst].set(self.v[:, rows, src], mode="drop")
        return KVCache(k, v, jnp.asarray(start + num_new, jnp.int32))

    def causal_mask(self, num_new: int) -> jax.Array:
        """bool[B, T, S]: new token t of row b sees the committed slots and new tokens 0..t."""
        slots = jnp.arange(self.capacity)[None, None, :]
        limit = self.lengths[:, None, None] + jnp.arange(num_new)[None, :, None]
        return slots <= limit
