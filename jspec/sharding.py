"""Batch-parallel generation over several devices, with ``jax.sharding`` and nothing else.

The generation loops are written for a batch; to spread it over devices, give
:class:`jspec.decode.Decoder` or :class:`jspec.engine.SpeculativeDecoder` a
``mesh`` (:func:`batch_mesh`: every local device). Rows are split over every axis
of the mesh and weights are replicated (a model that fits one device, which is
the case speculative decoding is for); XLA partitions the one jitted
``lax.while_loop`` from the inputs' shardings. The KV caches, the drafter's state
and each row's forwards stay on the row's device; what crosses devices per step is
small: the step's new keys and values (gathered for the cache write, B x T x
kv heads x head dim per layer), the tokens it emitted (the output buffer is kept
whole on every device), the loop's exit test and its counters.

A batch that does not divide evenly is padded with filler rows (a copy of the
first prompt with a budget of one token), which are dropped from the results
and never reach the statistics. With ``jax_threefry_partitionable`` (JAX's
default) a row's random draws depend neither on the batch size nor on the
device count, so a sharded run gives the same tokens as a single-device run,
sampled or greedy (``tests/test_sharding.py``).

One host only: the results are read back with ``np.asarray``, which needs every
shard addressable from this process.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["batch_mesh", "check_mesh", "padded_rows", "replicate", "shard_rows"]


def batch_mesh(devices=None, axis: str = "batch") -> Mesh:
    """A one-axis mesh over ``devices`` (default: every device JAX sees)."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("batch_mesh needs at least one device.")
    return Mesh(np.asarray(devices), (axis,))


def padded_rows(mesh: Mesh | None, num_rows: int) -> int:
    """The batch size the loop runs: ``num_rows`` rounded up to a multiple of the mesh's devices."""
    if mesh is None:
        return num_rows
    return -(-num_rows // mesh.size) * mesh.size


def check_mesh(mesh) -> None:
    """Raises ValueError, before anything is placed or compiled, for a mesh the loops cannot use."""
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh (e.g. jspec.sharding.batch_mesh()); got {type(mesh).__name__}."
        )
    if mesh.is_multi_process:
        raise ValueError(
            "the mesh spans several processes, but the generation loops read their results back on "
            "one host; build it from this process's devices: batch_mesh(jax.local_devices())."
        )


def replicate(mesh: Mesh | None, tree):
    """Every array of ``tree`` copied to every device of ``mesh`` (unchanged without a mesh)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def shard_rows(mesh: Mesh | None, tree, num_rows: int, total: int):
    """Arrays of ``tree`` with ``num_rows`` leading rows padded to ``total`` (repeating the last
    row) and split over all of the mesh's axes; scalars and other arrays are replicated.

    Without a mesh only the padding is done.
    """

    def place(x):
        x = jnp.asarray(x)
        per_row = x.ndim >= 1 and x.shape[0] == num_rows
        if per_row and total > num_rows:
            x = jnp.concatenate([x, jnp.repeat(x[-1:], total - num_rows, axis=0)])
        if mesh is None:
            return x
        spec = PartitionSpec(mesh.axis_names) if per_row else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(place, tree)
