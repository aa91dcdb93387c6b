"""Generation over a mesh of devices with ``data`` and ``model`` axes, with ``jax.sharding`` and nothing else.

Give :class:`jspec.loop.decode.Decoder`, :class:`jspec.loop.engine.SpeculativeDecoder` or
:class:`jspec.Speculator` a ``mesh`` (:func:`make_mesh`, or ``--mesh data=D,model=M`` on the
command line). The generation loops stay written for a batch on one device; XLA partitions
the one jitted ``lax.while_loop`` from the shardings of its inputs (GSPMD):

- ``data``: a batch's rows are split over it (:func:`shard_rows`), the KV caches and
  each row's drafter state with them.
- ``model``: the target's weights are split Megatron-style (:data:`MEGATRON`): q, k, v,
  gate and up by output (whole heads, whole MLP columns: :meth:`Transformer.unfused`),
  the attention output and the MLP's down projection by input (one all-reduce each per
  layer), the embedding and output layer by vocabulary where it divides; the KV cache is
  split over its KV heads (``constrain`` in :meth:`jspec.core.cache.KVCache.create`). Where the
  model axis is wider than the KV heads (Qwen2.5's 2, for example) k and v are kept whole
  on every device, as vLLM does. Drafters' weights (heads, draft models) are replicated:
  they are small by design.

Sharding changes where values live, never what they are: any rule gives the same values up
to float rounding (a split sum adds in another order). Random draws do not depend on the
layout (``jax_threefry_partitionable``, JAX's default), so a mesh gives a single device's
tokens, greedy or sampled (``tests/test_sharding.py``, meshes 1x8, 2x4, 4x2, 8x1).

A batch that does not divide over ``data`` is padded with filler rows (a copy of the first
prompt with a budget of one token), which are dropped from the results and statistics.

Several processes (``jax.distributed.initialize``: GPU hosts, TPU pod slices): build the mesh
over ``jax.devices()`` (every process's); each process passes the same prompts, the inputs are
placed with :func:`put`, and every process reads the whole result (:func:`to_host`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "DATA", "MEGATRON", "MODEL", "batch_mesh", "check_mesh", "constrain", "initialize", "make_mesh", "padded_rows",
    "parse_mesh", "place_model", "put", "replicate", "shard_rows", "to_host",
]  # fmt: skip

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# Which axis of a target weight the model axis splits (counted from the end: stacked layers
# add a leading axis). Matrices are [out, in]: -2 splits outputs (column-parallel), -1
# inputs (row-parallel). Weights not named here are replicated.
MEGATRON = {
    "wq": -2, "wk": -2, "wv": -2, "bq": -1, "bk": -1, "bv": -1,  # heads
    "wo": -1,  # the heads' outputs, summed over the model axis
    "w_gate": -2, "w_up": -2, "w_down": -1,  # the MLP's inner dimension
    "embed": -2, "lm_head": -2,  # the vocabulary
}  # fmt: skip
KV_WEIGHTS = ("wk", "wv", "bk", "bv")


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A mesh with axes ``("data", "model")`` over ``devices`` (default: every device JAX sees,
    every process's under ``jax.distributed``); ``data`` defaults to the devices left over."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("a mesh needs at least one device.")
    for name, size in (("data", data), ("model", model)):
        if size is not None and (not isinstance(size, int | np.integer) or isinstance(size, bool) or size < 1):
            raise ValueError(f"mesh {name} must be a positive integer; got {size!r}.")
    data = len(devices) // model if data is None else data
    if data * model != len(devices):
        raise ValueError(
            f"a mesh data={data} x model={model} needs {data * model} devices; {len(devices)} are visible "
            f"({jax.default_backend()}). Choose sizes whose product is {len(devices)}; on CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N (set before JAX starts) simulates N devices."
        )
    return Mesh(np.asarray(devices).reshape(data, model), AXES)


def initialize(coordinator: str, num_processes: int, process_id: int, timeout_s: int = 300) -> None:
    """``jax.distributed.initialize`` with its arguments checked first and its failures said plainly.

    Every process runs the same command with its own ``process_id`` (0 .. ``num_processes`` - 1);
    process 0 serves as the coordinator at ``coordinator`` (host:port, reachable by all). On
    Cloud TPU and SLURM clusters ``jax.distributed.initialize()`` finds these itself.
    """
    host, colon, port = str(coordinator).rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(f"the coordinator is host:port (process 0's address); got {coordinator!r}.")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"the process count must be a positive integer; got {num_processes!r}.")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"the process id must be in 0..{num_processes - 1} for {num_processes} processes; "
                         f"got {process_id!r}.")  # fmt: skip
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s)
    except Exception as e:  # the runtime's own errors are long C++ status strings
        raise ValueError(
            f"process {process_id} of {num_processes} could not join the coordinator at {coordinator} within "
            f"{timeout_s} s: every process needs the same coordinator and process count, and process 0 must run "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})."
        ) from None
    if jax.process_count() != num_processes:
        raise ValueError(
            f"the coordinator at {coordinator} runs {jax.process_count()} processes, not the {num_processes} this "
            "one was given: pass the same process count to every process."
        )


def batch_mesh(devices=None) -> Mesh:
    """Every device on the ``data`` axis: rows split, weights replicated."""
    return make_mesh(model=1, devices=devices)


def parse_mesh(text: str) -> dict:
    """``"data=2,model=4"`` → ``{"data": 2, "model": 4}`` (either may be left out)."""
    sizes = {}
    for part in str(text).split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in AXES or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(
                f"--mesh takes data=D,model=M with positive integers (either may be left out); got {text!r}."
            )
        if name in sizes:
            raise ValueError(f"--mesh names {name} twice: {text!r}.")
        sizes[name] = int(value)
    return sizes


def axis_size(mesh: Mesh | None, name: str) -> int:
    return 1 if mesh is None or name not in mesh.axis_names else int(mesh.shape[name])


def padded_rows(mesh: Mesh | None, num_rows: int) -> int:
    """The batch size the loop runs: ``num_rows`` rounded up to a multiple of the data axis."""
    data = axis_size(mesh, DATA)
    return -(-num_rows // data) * data


def check_mesh(mesh, config=None) -> None:
    """Raises ValueError, before anything is placed or compiled, for a mesh the loops cannot use:
    not a Mesh, axes other than ``data`` and ``model``, or a model axis that does not divide the
    target's attention heads (``config``), its KV heads (nor is a multiple of them) or its MLP."""
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh (jspec.loop.sharding.make_mesh); got {type(mesh).__name__}."
        )
    unknown = [a for a in mesh.axis_names if a not in AXES]
    if unknown:
        raise ValueError(
            f"mesh axes {unknown} are not jspec's: it splits rows over 'data' and weights over 'model'; "
            "build the mesh with jspec.loop.sharding.make_mesh(data=D, model=M)."
        )
    m = axis_size(mesh, MODEL)
    if config is None or m == 1:
        return
    heads, kv, inner = config.num_heads, config.num_kv_heads, config.intermediate_size
    fits = [d for d in range(1, heads + 1) if heads % d == 0 and inner % d == 0 and (kv % d == 0 or d % kv == 0)]
    if m not in fits:
        raise ValueError(
            f"mesh model={m} does not split this model ({heads} attention heads, {kv} KV heads, MLP width "
            f"{inner}): the model axis must divide the heads and the MLP, and divide the KV heads or be a "
            f"multiple of them. Sizes that fit: model={', '.join(map(str, fits))}."
        )


def constrain(x: jax.Array, axes: tuple) -> jax.Array:
    """``x`` split as ``axes`` (one mesh axis name or None per dimension) over the mesh being
    compiled for (:func:`jax.set_mesh`); unchanged without one. A dimension the axis does not
    divide stays whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = [a if a in mesh.axis_names and n % mesh.shape[a] == 0 else None for a, n in zip(axes, x.shape, strict=True)]
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def put(x, sharding: NamedSharding) -> jax.Array:
    """``x`` (the same value in every process) placed with ``sharding``, also over other processes' devices."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def to_host(tree):
    """Every array of ``tree`` as numpy, whole: gathered from the other processes' devices where needed."""

    def read(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(read, tree)


def replicate(mesh: Mesh | None, tree):
    """Every array of ``tree`` copied to every device of ``mesh`` (unchanged without a mesh)."""
    if mesh is None:
        return tree
    whole = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: put(x, whole), tree)


def weight_spec(name: str, shape: tuple, mesh: Mesh, config, rules: dict = MEGATRON) -> PartitionSpec:
    """Where the model axis splits the target weight ``name`` (replicated where ``rules`` say
    nothing, or the axis does not divide it, or it is k or v and the model axis exceeds the KV heads)."""
    m = axis_size(mesh, MODEL)
    axis = rules.get(name)
    if m == 1 or axis is None or shape[axis] % m or (name in KV_WEIGHTS and config.num_kv_heads % m):
        return PartitionSpec()
    spec = [None] * len(shape)
    spec[axis] = MODEL
    return PartitionSpec(*spec)


def place_model(mesh: Mesh | None, model, rules: dict = MEGATRON):
    """``nnx.split(model)`` with its weights placed on ``mesh``: split over the model axis by
    ``rules`` (q, k, v and gate, up unfused first) or replicated; unplaced without a mesh."""

    config = getattr(model, "config", None)
    if mesh is None or axis_size(mesh, MODEL) == 1 or not hasattr(model, "unfused"):
        graphdef, state = nnx.split(model)
        return graphdef, replicate(mesh, state)
    graphdef, state = nnx.split(model.unfused())
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        value = var[...]
        sharding = NamedSharding(mesh, weight_spec(str(path[-1]), value.shape, mesh, config, rules))
        flat[path] = var.replace(put(value, sharding))
    return graphdef, nnx.from_flat_state(flat)


def shard_rows(mesh: Mesh | None, tree, num_rows: int, total: int):
    """Arrays of ``tree`` with ``num_rows`` leading rows padded to ``total`` (repeating the last
    row) and split over the mesh's data axis; scalars and other arrays are replicated.

    Without a mesh only the padding is done.
    """

    def place(x):
        x = jnp.asarray(x)
        per_row = x.ndim >= 1 and x.shape[0] == num_rows
        if per_row and total > num_rows:
            x = jnp.concatenate([x, jnp.repeat(x[-1:], total - num_rows, axis=0)])
        if mesh is None:
            return x
        spec = PartitionSpec(DATA) if per_row and DATA in mesh.axis_names else PartitionSpec()
        return put(x, NamedSharding(mesh, spec))

    return jax.tree.map(place, tree)
