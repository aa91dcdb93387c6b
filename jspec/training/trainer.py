"""Training a head: the optimizer, the data order and a trainer whose runs resume from orbax checkpoints.

A run checkpoints parameters, optimizer state and the step every
``checkpoint_every`` steps; the data order is a pure function of (seed, step),
so a resumed run sees exactly the batches it would have seen.

Several devices (:meth:`Trainer.shard`): the step is the one-device step, jitted over a
``("data", "model")`` mesh from the shardings of its inputs (GSPMD): each batch's rows split over
``data`` (the gradient's sum over them becomes an all-reduce), the head's parameters and the
optimizer state with them replicated, the frozen target's weights (online features, output rows)
split over ``model`` as generation splits them. Gradient accumulation (``accumulate``) runs a
step's batch as micro-batches in a ``lax.scan``, each mean taken over the whole batch's counts,
so either gives one device's step up to float rounding (``tests/test_train_mesh.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jspec.heads.eagle import DraftHead
from jspec.loop.sharding import DATA, axis_size, check_mesh, place_model, replicate, shard_rows, to_host
from jspec.training.loss import head_loss, loss_window, token_counts
from jspec.training.medusa import medusa_loss

__all__ = ["PEAK_FLOPS", "TrainConfig", "Trainer", "batch_order", "make_optimizer", "peak_flops"]

COMPUTE_DTYPES = ("float32", "bfloat16")

# Dense bfloat16 peak FLOP/s per device, from the vendors' data sheets (SXM parts; TPU per chip):
# the denominator of the training log's ``peak_fraction``. Devices not named here (CPUs) get none.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12,
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
}  # fmt: skip


def peak_flops(device) -> float | None:
    """The dense bfloat16 peak FLOP/s of ``device`` (a ``jax.Device``), or None where not known (CPUs)."""
    kind = str(getattr(device, "device_kind", ""))
    return next((v for k, v in PEAK_FLOPS.items() if k.lower() in kind.lower()), None)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    num_steps: int = 7  # TTT steps (1 = no training-time test)
    decay: float = 0.8
    batch_size: int = 8
    learning_rate: float = 3e-4
    warmup_steps: int = 50
    total_steps: int = 1000
    weight_decay: float = 0.01
    clip_norm: float = 0.5
    regression_weight: float = 1.0  # EAGLE-1's feature loss (the token loss weighs 0.1 there)
    checkpoint_every: int = 200
    seed: int = 0
    accumulate: int = 1  # micro-batches per step: a step trains on batch_size * accumulate examples
    compute_dtype: str = "float32"  # "bfloat16": forward and backward in bf16; weights and optimizer float32

    def __post_init__(self):
        for name in ("num_steps", "batch_size", "total_steps", "checkpoint_every", "accumulate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}.")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}; got {self.compute_dtype!r}.")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be at least 0 and below total_steps "
                             f"({self.total_steps}); use fewer warmup steps or more steps.")  # fmt: skip


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay, after clipping the global gradient norm."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, config.total_steps,
        end_value=config.learning_rate * 0.1,
    )  # fmt: skip
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm), optax.adamw(schedule, weight_decay=config.weight_decay)
    )


def batch_order(num_examples: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """The example indices of training step ``step``: epochs of seeded permutations, a pure function of the step."""
    per_epoch = max(num_examples // batch_size, 1)
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
    idx = perm[i * batch_size : (i + 1) * batch_size]
    if len(idx) < batch_size:  # fewer examples than one batch
        idx = np.resize(perm, batch_size)
    return idx


class Trainer:
    """Trains a head on prepared data; checkpoints and resumes with orbax.

    The loss is EAGLE's (:func:`head_loss`, against the target's final norm and output rows), or
    ``loss(head, batch, window, counts) -> (loss, metrics)`` for another kind of head (:meth:`for_medusa`;
    ``counts``: the means' denominators, :func:`token_counts`).
    """

    def __init__(self, head: DraftHead, target_norm, target_rows, rms_eps: float, config: TrainConfig,
                 checkpoint_dir: str | pathlib.Path | None = None, loss=None):  # fmt: skip
        self.config = config
        self.loss = loss
        self.graphdef, params, self.frozen = nnx.split(head, nnx.Param, ...)
        # The trainer owns (and donates) its own copies: a parameter that shares a buffer with the
        # target or the frozen arrays (a head initialized from the target's weights) stays intact.
        self.params = jax.tree.map(jnp.copy, params)
        self.tx = make_optimizer(config)
        self.opt_state = self.tx.init(self.params)
        self.step = 0
        self.target = () if target_norm is None else (jnp.asarray(target_norm), jnp.asarray(target_rows))
        self.rms_eps = rms_eps
        self.manager = None
        if checkpoint_dir is not None:
            import orbax.checkpoint as ocp  # imported here: orbax adds start-up time; only checkpointed runs need it

            # Synchronous saves: when fit() moves past a checkpoint step, that checkpoint is on disk.
            options = ocp.CheckpointManagerOptions(
                max_to_keep=2, save_interval_steps=config.checkpoint_every, enable_async_checkpointing=False
            )
            self.manager = ocp.CheckpointManager(pathlib.Path(checkpoint_dir).absolute(), options=options)
        self._online = None  # (the target's graphdef, its weights, layers): features made in the step
        self.mesh = None
        self._step_fn = jax.jit(self._train_step, donate_argnums=(0, 1), static_argnames="window")

    @classmethod
    def for_target(cls, head: DraftHead, target, config: TrainConfig, checkpoint_dir=None) -> Trainer:
        """A trainer of ``head`` (attached to ``target``) against the target's distribution: its
        final norm and its output rows for the head's draft vocabulary."""
        rows = target.output_weights()[head.d2t[...]]
        return cls(head, target.final_norm_weight(), rows, target.config.rms_eps, config, checkpoint_dir)

    def features_online(self, target, layers: tuple[int, ...]) -> Trainer:
        """Computes the target's hidden states at ``layers`` and its last layer inside each training
        step, from the batch's tokens (SpecForge's "online" mode): the data holds token ids and masks
        only. The target is frozen (no gradient reaches it) and its weights are an argument of the
        step. (Stored features are float16; these stay in the target's dtype.)"""
        graphdef, weights = nnx.split(target)
        self._online = (graphdef, weights, (*layers, target.config.num_layers - 1))
        return self

    @property
    def data_keys(self) -> tuple[str, ...]:
        """The arrays :meth:`fit` reads from the data."""
        return ("tokens", "mask") if self._online else ("tokens", "mask", "features", "top")

    @classmethod
    def for_medusa(cls, heads, config: TrainConfig, checkpoint_dir=None) -> Trainer:
        """A trainer of Medusa heads (attached to their target): :func:`jspec.training.medusa.medusa_loss`
        with ``config.decay`` per head; ``config.num_steps`` must be the number of heads (the loss window)."""

        if config.num_steps != heads.config.num_heads:
            raise ValueError(f"config.num_steps ({config.num_steps}) must equal the number of Medusa heads "
                             f"({heads.config.num_heads}): it sizes the loss window.")  # fmt: skip
        loss = lambda head, batch, window, counts: medusa_loss(head, batch, config.decay, window, counts)  # noqa: E731
        return cls(heads, None, None, 0.0, config, checkpoint_dir, loss=loss)

    def shard(self, mesh) -> Trainer:
        """Trains over ``mesh`` (:func:`jspec.loop.sharding.make_mesh`; see the module docstring): batches split
        over its ``data`` axis, the target's weights over ``model``. Call before :meth:`restore`; a
        checkpoint written on any mesh (or one device) restores onto any other."""

        online = self._online
        check_mesh(mesh, None if online is None else nnx.merge(online[0], online[1]).config)
        data = axis_size(mesh, DATA)
        if self.config.batch_size % data:
            raise ValueError(
                f"the batch of {self.config.batch_size} rows (a micro-batch, with accumulation) does not split over "
                f"the mesh's data axis of {data}: choose a batch size that is a multiple of {data}."
            )  # fmt: skip
        self.mesh = mesh
        self.params, self.opt_state, self.frozen, self.target = replicate(
            mesh, (self.params, self.opt_state, self.frozen, self.target)
        )
        if online is not None:
            graphdef, weights = place_model(mesh, nnx.merge(online[0], online[1]))
            self._online = (graphdef, weights, online[2])
        return self

    def _compute(self, tree):
        """The floating arrays of ``tree`` in the compute dtype (the float32 masters stay as they are)."""
        dtype = jnp.dtype(self.config.compute_dtype)
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def _with_features(self, batch, weights):
        """``batch`` with the frozen target's features (online mode); unchanged with stored features."""
        if weights is None:
            return batch
        graphdef, _, layers = self._online
        tokens = batch["tokens"]
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        model = nnx.merge(graphdef, jax.lax.stop_gradient(weights))
        out = model(tokens, positions, model.init_cache(b, t), hidden_layers=layers).hidden_states
        # In the target's own dtype, not rounded to float16 as stored features are: nothing is stored, and
        # a float16 rounding flips on the last bit of a sum split over devices (a mesh's step then differs).
        return batch | {"features": jnp.stack(out[:-1], axis=2), "top": out[-1]}

    def _train_step(self, params, opt_state, frozen, target, batch, window=None, weights=None):
        c = self.config
        counts = token_counts(batch["mask"], c.num_steps, window)  # the whole batch's: micro-batches add up
        frozen, target = self._compute(frozen), self._compute(target)

        def grads(micro):
            micro = self._with_features(micro, weights)

            def loss_fn(params):
                head = nnx.merge(self.graphdef, self._compute(params), frozen)
                if self.loss is not None:
                    return self.loss(head, micro, window, counts)
                return head_loss(head, micro, *target, self.rms_eps, c.num_steps, c.decay, c.regression_weight,
                                 window, counts)  # fmt: skip

            (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
            return g, metrics | {"total": loss}

        if c.accumulate == 1:
            g, metrics = grads(batch)
        else:
            # Micro-batch j holds rows j, j + K, j + 2K, ...: every device's rows feed every micro-batch.
            micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, c.accumulate, *x.shape[1:]), 0, 1), batch)
            zero = jax.tree.map(
                lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(grads, jax.tree.map(lambda x: x[0], micro))
            )

            def add(total, one):
                return jax.tree.map(jnp.add, total, grads(one)), None

            (g, metrics), _ = jax.lax.scan(add, zero, micro)
        updates, opt_state = self.tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, metrics | {"grad_norm": optax.tree.norm(g)}

    def _place_batch(self, batch: dict) -> dict:
        rows = len(batch["tokens"])
        return shard_rows(self.mesh, batch, rows, rows)

    def _mesh_context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def train_step(self, batch: dict, window: int | None = None) -> dict:
        """One optimizer step on ``batch`` (arrays as in :meth:`fit`: ``batch_size * accumulate`` rows);
        returns its metrics. ``window``: the loss window's width (:func:`loss_window`), or None to run
        every TTT step on every row. Each distinct width compiles once."""
        weights = None if self._online is None else self._online[1]
        with self._mesh_context():
            self.params, self.opt_state, metrics = self._step_fn(
                self.params, self.opt_state, self.frozen, self.target, self._place_batch(batch), window=window,
                weights=weights,
            )  # fmt: skip
        self.step += 1
        return metrics

    def step_flops(self, batch: dict, window: int | None = None) -> float | None:
        """The floating-point operations of one step on ``batch`` as XLA counts them (its cost analysis of
        the lowered step; None where the backend gives none)."""
        weights = None if self._online is None else self._online[1]
        with self._mesh_context():
            lowered = self._step_fn.lower(self.params, self.opt_state, self.frozen, self.target,
                                          self._place_batch(batch), window=window, weights=weights)  # fmt: skip
        cost = lowered.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        flops = None if not cost else cost.get("flops")
        return None if flops is None or flops <= 0 else float(flops)

    def restore(self) -> bool:
        """Loads the latest checkpoint if there is one; returns whether it did."""
        if self.manager is None or self.manager.latest_step() is None:
            return False
        import orbax.checkpoint as ocp  # imported here: orbax adds start-up time; only checkpointed runs need it

        step = self.manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._saved())
        try:
            saved = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except Exception as err:  # orbax and tensorstore raise assorted errors on damaged or foreign files
            folder = self.manager.directory / str(step)
            earlier = [s for s in self.manager.all_steps() if s != step]
            raise ValueError(
                f"the checkpoint {folder} cannot be restored ({type(err).__name__}: {str(err)[:200]}): it is damaged "
                f"or was written for another head or optimizer. Delete that folder to resume from "
                f"{f'step {max(earlier)}' if earlier else 'the start'}, or train into another --out."
            ) from err
        self.params, self.opt_state, self.step = saved["params"], saved["opt_state"], int(saved["step"])
        return True

    def _saved(self):
        return {"params": self.params, "opt_state": self.opt_state, "step": np.asarray(self.step, np.int64)}

    def save(self, force: bool = False) -> None:
        """Checkpoints at the interval's steps (or now, with ``force``); a step is saved once."""
        if self.manager is not None and self.step not in self.manager.all_steps():
            import orbax.checkpoint as ocp  # imported here: orbax adds start-up time; only checkpointed runs need it

            self.manager.save(self.step, args=ocp.args.StandardSave(self._saved()), force=force)

    def fit(self, data: dict, until: int | None = None, progress=None, log_every: int = 10) -> list[dict]:
        """Trains up to step ``until`` (default: the config's total); returns the logged metrics.

        Args:
          data: numpy arrays ``tokens`` [N, T], ``mask`` [N, T], ``features`` [N, T, n, H], ``top`` [N, T, H]
            (the last two not with :meth:`features_online`). Every process passes the same.
          progress: an optional callable(step, metrics) for a progress display.

        Each logged row: ``step``, ``seconds`` (that step's wall time), ``tokens_per_s`` (the batch's
        tokens, padding included, over it), ``peak_fraction`` (the step's FLOP/s over the devices'
        bfloat16 peak, :data:`PEAK_FLOPS`; None where the peak is not known, as on CPUs) and the
        step's metrics.
        """

        c = self.config
        until = c.total_steps if until is None else min(until, c.total_steps)
        n, rows = len(data["tokens"]), c.batch_size * c.accumulate
        window = loss_window(data["mask"], c.num_steps)  # one width for the whole run: one compilation
        devices = [jax.devices()[0]] if self.mesh is None else list(self.mesh.devices.flat)
        peaks = [peak_flops(d) for d in devices]  # the step's FLOPs are the whole mesh's
        flops = None
        history = []
        while self.step < until:
            idx = np.sort(batch_order(n, rows, self.step, c.seed))
            batch = {key: data[key][idx] for key in self.data_keys}
            if flops is None and all(peaks):
                flops = self.step_flops(batch, window)
            t0 = time.perf_counter()
            metrics = self.train_step(batch, window)
            if self.step % log_every == 0 or self.step == until:
                values = {k: v.tolist() for k, v in to_host(metrics).items()}  # waits for the step
                seconds = time.perf_counter() - t0
                fraction = None if flops is None else flops / seconds / sum(peaks)
                row = {"step": self.step, "seconds": seconds, "tokens_per_s": batch["tokens"].size / seconds,
                       "peak_fraction": fraction} | values  # fmt: skip
                history.append(row)
                if progress is not None:
                    progress(self.step, row)
            self.save()
        self.save(force=True)
        if self.manager is not None:
            self.manager.wait_until_finished()
        return history

    def head(self) -> DraftHead:
        """The trained head, its arrays on the host's default device (gathered from a mesh)."""

        if self.mesh is None:
            params, frozen = self.params, self.frozen
        else:
            params, frozen = jax.tree.map(jnp.asarray, to_host((self.params, self.frozen)))
        return nnx.merge(self.graphdef, params, frozen)
