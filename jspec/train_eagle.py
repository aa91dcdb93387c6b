"""Training EAGLE heads: training-time test, the loss, the optimizer, resumable runs.

Data is a set of fixed-length sequences with the target's hidden states
already computed (see :mod:`jspec.eagle_data`): tokens int32[T], a loss mask
(the response tokens), the hidden states at the head's feature layers
[T, n, H] and at the target's top layer [T, H] (float16 on disk). The
target's distribution at a position is recomputed from the top layer with
the target's final norm and output rows for the draft vocabulary (frozen
copies), restricted to the draft vocabulary and renormalized.

Training-time test (EAGLE-3): the head runs ``num_steps`` steps; step 0 reads
the fused target features, step k > 0 reads the head's own outputs of step
k - 1 at the same rows and the tokens k positions further on. Row t of step
k predicts token t + k + 2 and attends to the context (step 0 rows <= t) and
its own earlier steps at row t (:func:`jspec.eagle.ttt_mask`). Step 0 runs on
every row; the later steps, the output layer and the loss run on each
example's loss window only, the rows whose predicted token is a response
token (:func:`loss_window`; the same loss, half the step time here). The loss is
sum_k decay^k * CE_k. EAGLE-1 (one step, no TTT) adds a smooth-L1 regression
of the next top-layer feature.

A run checkpoints parameters, optimizer state and the step every
``checkpoint_every`` steps with orbax; the data order is a pure function of
(seed, step), so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jspec.cache import KVCache
from jspec.eagle import DraftHead, ttt_mask
from jspec.models.llama import linear, rms_norm

__all__ = [
    "PROMPT_SOURCES", "Recipe", "TrainConfig", "Trainer", "batch_order", "head_loss", "load_extra_data",
    "loss_window", "make_optimizer", "prepare_data", "teacher_forced_agreement", "train_head", "ttt_forward",
    "window_starts",
]  # fmt: skip


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

    def __post_init__(self):
        for name in ("num_steps", "batch_size", "total_steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}.")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be at least 0 and below total_steps "
                             f"({self.total_steps}); pass a smaller --warmup or more --steps.")  # fmt: skip


def _rows(x, index, fill=0):
    """x[b, index[b, i]] for x [B, T, ...] and index int[B, W]; ``fill`` where the index is past T."""
    inside = index < x.shape[1]
    index = jnp.minimum(index, x.shape[1] - 1)
    got = jnp.take_along_axis(x, index.reshape(*index.shape, *([1] * (x.ndim - 2))), axis=1)
    return jnp.where(inside.reshape(*index.shape, *([1] * (x.ndim - 2))), got, jnp.asarray(fill, x.dtype))


def loss_window(mask, num_steps: int) -> int:
    """The fewest consecutive rows that hold every row with a loss at any TTT step, over a data set.

    Row r of step k has a loss when token r + k + 2 is a response token; responses are one
    run of tokens per example, so each example's loss rows are one run of (response length
    + ``num_steps`` - 1) rows. Steps after the first run on this window only, and every
    step's output layer and loss too. Rounded up to a multiple of 8 (fewer shapes to compile).

    Args:
      mask: bool[N, T], the response tokens of every example.

    Raises:
      ValueError: when an example's response tokens are not one run.
    """
    mask = np.asarray(mask, bool)
    t = mask.shape[1]
    counts = mask.sum(1)
    first = mask.argmax(1)
    last = t - 1 - mask[:, ::-1].argmax(1)
    gaps = (counts > 0) & (last - first + 1 != counts)
    if gaps.any():
        raise ValueError(f"example {int(np.argmax(gaps))}'s response tokens are not one run; the loss mask must "
                         "mark one response per sequence (as jspec.eagle_data writes it).")  # fmt: skip
    width = int(counts.max(initial=0)) + num_steps - 1
    return max(1, min(t - 1, -(-width // 8) * 8))


def window_starts(mask, num_steps: int, window: int | None) -> jax.Array:
    """int32[B]: each row's first window row (see :func:`loss_window`); zeros without a window."""
    b, t = mask.shape
    if window is None:
        return jnp.zeros((b,), jnp.int32)
    first = jnp.argmax(mask, axis=1).astype(jnp.int32)  # the first response token
    return jnp.clip(first - num_steps - 1, 0, t - 1 - window)


def ttt_forward(head: DraftHead, tokens, feature, num_steps: int, starts=None, window: int | None = None):
    """The head's outputs at each training-time-test step: a list of [B, W, H].

    Row r of step k reads token r + k + 1 at position r + k + 1 with the feature of
    step k - 1's row r (step 0: ``feature``, the fused target feature of token r),
    attends as :func:`jspec.eagle.ttt_mask` allows, and predicts token r + k + 2:
    what drafting step k does at inference after the pair of row r was committed.

    Step 0 runs on every row (each is context for later steps); steps k > 0 run on the
    ``window`` rows from ``starts`` only, and the outputs are those rows' (without a
    window: all T - 1 rows, W = T - 1). The keys are step 0's T - 1 rows, then W per later step.

    Args:
      tokens: int32[B, T]; feature: [B, T - 1, H]; starts: int32[B] (see :func:`window_starts`).
    """
    c = head.config
    b, t = tokens.shape
    m = t - 1
    w = m if window is None else window
    starts = jnp.zeros((b,), jnp.int32) if starts is None else starts
    cache = KVCache.create(1, b, m + (num_steps - 1) * w, c.num_kv_heads, c.head_dim)
    rows = jnp.broadcast_to(jnp.arange(m)[None, :], (b, m))
    context = jnp.broadcast_to(ttt_mask(m, 0, num_steps, 0, w)[None], (b, m, cache.capacity))
    out, cache = head(tokens[:, 1:], feature, rows + 1, cache, context)
    win = starts[:, None] + jnp.arange(w)[None, :]  # [B, W], rows of the whole sequence
    outputs = [_rows(out, win)]
    for k in range(1, num_steps):
        attn_mask = jax.vmap(lambda start, k=k: ttt_mask(m, k, num_steps, start, w))(starts)
        cache = cache.rollback(jnp.full((b,), m + (k - 1) * w, jnp.int32))
        out, cache = head(_rows(tokens, win + k + 1), outputs[-1], win + k + 1, cache, attn_mask)
        outputs.append(out)
    return outputs


def head_loss(head: DraftHead, batch: dict, target_norm, target_rows, rms_eps: float, num_steps: int, decay: float,
              regression_weight: float = 1.0, window: int | None = None):  # fmt: skip
    """(loss, metrics) of one batch.

    Args:
      batch: ``tokens`` int32[B, T], ``mask`` bool[B, T] (token t is a response token
        to predict), ``features`` [B, T, n, H], ``top`` [B, T, H].
      target_norm, target_rows: the target's final norm [H] and output rows for the draft
        vocabulary [K, H]: the target distribution at a position.
      num_steps: TTT steps (EAGLE-1: 1).
      window: static; rows per example that hold every loss (:func:`loss_window`): the
        steps after the first, the output layer and the loss run there only. None: all rows.
        The loss is the same either way.

    Returns:
      The weighted loss and a dict with per-step ``loss`` and ``acc`` (top-1 agreement with
      the target on the draft vocabulary), arrays [num_steps].
    """
    tokens, mask = batch["tokens"], batch["mask"]
    t = tokens.shape[1]
    if t < 3:
        raise ValueError(f"training sequences need at least 3 tokens; got {t}.")
    m = t - 1  # rows: pair (feature of token r, token r + 1), r = 0 .. T - 2
    w = m if window is None else window
    features = batch["features"].astype(jnp.float32)
    top = batch["top"].astype(jnp.float32)
    if head.config.kind == "eagle1":  # EAGLE-1 reads the top layer
        feature = head.fuse((top[:, :m],))
    else:
        feature = head.fuse(tuple(features[:, :m, i] for i in range(features.shape[2])))
    starts = window_starts(mask, num_steps, window)
    # The target's outputs at positions r + k + 1 of the window's rows r, every step k.
    ahead = starts[:, None] + 1 + jnp.arange(w + num_steps - 1)[None, :]
    top_ahead = _rows(top, ahead)
    target_logp = jax.nn.log_softmax(linear(rms_norm(top_ahead, target_norm, rms_eps), target_rows), axis=-1)
    mask_ahead = _rows(mask, ahead + 1, False)  # token r + k + 2 exists and is a response token
    total = jnp.float32(0.0)
    losses, accs = [], []
    for k, h in enumerate(ttt_forward(head, tokens, feature, num_steps, starts, window)):
        logp = jax.nn.log_softmax(head.logits(h), axis=-1)
        tgt = target_logp[:, k : k + w]
        valid = mask_ahead[:, k : k + w]
        ce = -jnp.sum(jnp.exp(tgt) * logp, axis=-1)
        count = jnp.maximum(valid.sum(), 1)
        loss_k = jnp.sum(jnp.where(valid, ce, 0.0)) / count
        acc_k = jnp.sum(valid & (logp.argmax(-1) == tgt.argmax(-1))) / count
        if head.config.kind == "eagle1":
            nxt = top_ahead[:, k : k + w]  # the next top-layer feature, what EAGLE-1 regresses
            reg = jnp.sum(optax.huber_loss(h, nxt).mean(-1) * valid) / count
            loss_k = regression_weight * reg + 0.1 * loss_k
        total = total + (decay**k) * loss_k
        losses.append(loss_k)
        accs.append(acc_k)
    return total, {"loss": jnp.stack(losses), "acc": jnp.stack(accs)}


def teacher_forced_agreement(head: DraftHead, target, sequences, prompt_lengths, num_steps: int) -> np.ndarray:
    """How often the head's top-1 draft at each TTT step is the token that follows, on given text.

    Each sequence is a prompt and a continuation (at temperature 0: the target's own greedy
    response, so a draft that agrees is a draft greedy verification accepts). Row r of step k
    drafts token r + k + 2 after the true tokens up to r + k + 1, as in training
    (:func:`ttt_forward`); only drafts a decoding loop could make count (continuation tokens after
    the first, which the target writes itself at the end of prefill). One batched target forward
    and one head pass, no decoding loop: a cheap held-out check of a head, and the chance a chain
    draft at position k is accepted when its earlier drafts were.

    Args:
      sequences: lists of target token ids, each a prompt followed by its continuation.
      prompt_lengths: the prompt's length in each sequence (at least 1).
      num_steps: TTT steps to score (draft positions 1 .. num_steps).

    Returns:
      float[num_steps, 2]: per step, (drafts that agree, drafts scored).
    """
    lengths = np.array([len(s) for s in sequences])
    prompt_lengths = np.asarray(prompt_lengths)
    if len(sequences) != len(prompt_lengths) or np.any(prompt_lengths < 1) or np.any(prompt_lengths > lengths):
        raise ValueError("each sequence needs a prompt length between 1 and its own length.")
    b, t = len(sequences), int(lengths.max()) + 1  # one pad column: every row has a pair to the end
    tokens = np.zeros((b, t), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s  # right padding: causal attention keeps it out of the real rows
    c = head.config
    layers = (c.num_target_layers - 1,) if c.kind == "eagle1" else c.feature_layers
    positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    hidden = target(jnp.asarray(tokens), positions, target.init_cache(b, t), hidden_layers=layers).hidden_states
    outs = ttt_forward(head, jnp.asarray(tokens), head.fuse(hidden)[:, :-1], num_steps)
    d2t = np.asarray(head.d2t[...])
    rows = np.arange(t - 1)[None, :]
    counts = np.zeros((num_steps, 2))
    for k, h in enumerate(outs):
        draft = d2t[np.asarray(jnp.argmax(head.logits(h), axis=-1))]  # [B, T - 1], drafts token r + k + 2
        truth = tokens[:, np.minimum(rows[0] + k + 2, t - 1)]
        # as in decoding: the target writes the first continuation token, draft k comes k + 1 after the pending one
        scored = (rows + 1 >= prompt_lengths[:, None]) & (rows + k + 2 < lengths[:, None])
        counts[k] = (np.sum(scored & (draft == truth)), np.sum(scored))
    return counts


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
    """Trains a head on prepared data; checkpoints and resumes with orbax."""

    def __init__(self, head: DraftHead, target_norm, target_rows, rms_eps: float, config: TrainConfig,
                 checkpoint_dir: str | pathlib.Path | None = None):  # fmt: skip
        self.config = config
        self.graphdef, params, self.frozen = nnx.split(head, nnx.Param, ...)
        # The trainer owns (and donates) its own copies: a parameter that shares a buffer with the
        # target or the frozen arrays (a head initialized from the target's weights) stays intact.
        self.params = jax.tree.map(jnp.copy, params)
        self.tx = make_optimizer(config)
        self.opt_state = self.tx.init(self.params)
        self.step = 0
        self.target = (jnp.asarray(target_norm), jnp.asarray(target_rows))
        self.rms_eps = rms_eps
        self.manager = None
        if checkpoint_dir is not None:
            import orbax.checkpoint as ocp

            # Synchronous saves: when fit() moves past a checkpoint step, that checkpoint is on disk.
            options = ocp.CheckpointManagerOptions(
                max_to_keep=2, save_interval_steps=config.checkpoint_every, enable_async_checkpointing=False
            )
            self.manager = ocp.CheckpointManager(pathlib.Path(checkpoint_dir).absolute(), options=options)
        self._step_fn = jax.jit(self._train_step, donate_argnums=(0, 1), static_argnames="window")

    @classmethod
    def for_target(cls, head: DraftHead, target, config: TrainConfig, checkpoint_dir=None) -> Trainer:
        """A trainer of ``head`` (attached to ``target``) against the target's distribution: its
        final norm and its output rows for the head's draft vocabulary."""
        rows = target.output_weights()[head.d2t[...]]
        return cls(head, target.final_norm[...], rows, target.config.rms_eps, config, checkpoint_dir)

    def _train_step(self, params, opt_state, frozen, target, batch, window=None):
        c = self.config

        def loss_fn(params):
            head = nnx.merge(self.graphdef, params, frozen)
            return head_loss(head, batch, *target, self.rms_eps, c.num_steps, c.decay, c.regression_weight, window)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, metrics | {"total": loss, "grad_norm": optax.tree.norm(grads)}

    def train_step(self, batch: dict, window: int | None = None) -> dict:
        """One optimizer step on ``batch`` (arrays as in :meth:`fit`, one row per example); returns its
        metrics. ``window``: the loss window's width (:func:`loss_window`), or None to run every TTT
        step on every row. Each distinct width compiles once."""
        self.params, self.opt_state, metrics = self._step_fn(self.params, self.opt_state, self.frozen,
                                                             self.target, batch, window=window)  # fmt: skip
        self.step += 1
        return metrics

    def restore(self) -> bool:
        """Loads the latest checkpoint if there is one; returns whether it did."""
        if self.manager is None or self.manager.latest_step() is None:
            return False
        import orbax.checkpoint as ocp

        step = self.manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._saved())
        saved = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        self.params, self.opt_state, self.step = saved["params"], saved["opt_state"], int(saved["step"])
        return True

    def _saved(self):
        return {"params": self.params, "opt_state": self.opt_state, "step": np.asarray(self.step, np.int64)}

    def save(self, force: bool = False) -> None:
        """Checkpoints at the interval's steps (or now, with ``force``); a step is saved once."""
        if self.manager is not None and self.step not in self.manager.all_steps():
            import orbax.checkpoint as ocp

            self.manager.save(self.step, args=ocp.args.StandardSave(self._saved()), force=force)

    def fit(self, data: dict, until: int | None = None, progress=None, log_every: int = 10) -> list[dict]:
        """Trains up to step ``until`` (default: the config's total); returns the logged metrics.

        Args:
          data: numpy arrays ``tokens`` [N, T], ``mask`` [N, T], ``features`` [N, T, n, H], ``top`` [N, T, H].
          progress: an optional callable(step, metrics) for a progress display.
        """
        c = self.config
        until = c.total_steps if until is None else min(until, c.total_steps)
        n = len(data["tokens"])
        window = loss_window(data["mask"], c.num_steps)  # one width for the whole run: one compilation
        history = []
        while self.step < until:
            idx = np.sort(batch_order(n, c.batch_size, self.step, c.seed))
            batch = {key: jnp.asarray(data[key][idx]) for key in ("tokens", "mask", "features", "top")}
            t0 = time.perf_counter()
            metrics = self.train_step(batch, window)
            if self.step % log_every == 0 or self.step == until:
                row = {"step": self.step, "seconds": time.perf_counter() - t0}
                row |= {k: np.asarray(v).tolist() for k, v in metrics.items()}
                history.append(row)
                if progress is not None:
                    progress(self.step, row)
            self.save()
        self.save(force=True)
        if self.manager is not None:
            self.manager.wait_until_finished()
        return history

    def head(self) -> DraftHead:
        return nnx.merge(self.graphdef, self.params, self.frozen)


# ---------------------------------------------------------------------- the whole recipe


PROMPT_SOURCES = {
    "stdlib": "Python standard library docstrings and sources (jspec.eagle_data.stdlib_prompts)",
    "self": "written by the target from its chat template (jspec.eagle_data.self_instruct_prompts, Magpie)",
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that decides a trained head besides the target: data, head and training options."""

    kind: str = "eagle3"
    prompt_source: str = "stdlib"  # "stdlib" (standard-library docs) or "self" (written by the target)
    num_prompts: int = 2000
    seq_len: int = 256
    max_new_tokens: int = 192
    gen_batch: int = 16
    gen_temperature: float = 0.0
    draft_vocab: int = 8192
    feature_layers: tuple[int, ...] | None = None
    train: TrainConfig = TrainConfig()
    init_from: str | None = None  # a saved head to start from (its draft vocabulary is kept)
    warm_start: bool = False  # a new head starts from the target's weights (DraftHead.warm_start)

    def __post_init__(self):
        if self.prompt_source not in PROMPT_SOURCES:
            raise ValueError(f"unknown prompt source {self.prompt_source!r}; choose from {', '.join(PROMPT_SOURCES)}.")
        if self.init_from and self.warm_start:
            raise ValueError("a recipe starts from a saved head (init_from) or from the target (warm_start), not both.")

    @classmethod
    def tiny(cls, kind: str = "eagle3") -> Recipe:
        """Small enough for tests and notebooks (8 prompts, 12 steps); the head it makes is not useful."""
        train = TrainConfig(num_steps=2 if kind == "eagle3" else 1, batch_size=4, total_steps=12, warmup_steps=2,
                            checkpoint_every=4, learning_rate=1e-3)  # fmt: skip
        return cls(kind, num_prompts=8, seq_len=128, max_new_tokens=24, gen_batch=8, draft_vocab=512, train=train)


def prepare_data(target, tokenizer, recipe: Recipe, folder: pathlib.Path, model_name: str, bars=None) -> dict:
    """The training set in ``folder``: loaded when a complete one made by the same recipe is there, else made.

    ``bars``: a factory ``(description, total) -> progress callback or None``, called when each stage starts.
    """
    from jspec.eagle import HeadConfig
    from jspec.eagle_data import generate_examples, load_shards, self_instruct_prompts, stdlib_prompts, write_shards

    layers = HeadConfig.for_target(target.config, "eagle3", 1, recipe.feature_layers).feature_layers
    want = {"model": model_name, "prompt_source": recipe.prompt_source, "feature_layers": list(layers),
            "num_prompts": recipe.num_prompts, "seq_len": recipe.seq_len, "max_new_tokens": recipe.max_new_tokens,
            "gen_temperature": recipe.gen_temperature}  # fmt: skip
    if recipe.prompt_source == "self":  # the seed picks which prompts the target writes
        want["prompt_seed"] = recipe.train.seed
    defaults = {"prompt_source": "stdlib", "prompt_seed": 0}  # data sets written before these were recorded
    folder = pathlib.Path(folder)
    if (folder / "meta.json").exists():
        data, meta = load_shards(folder)
        if {k: meta.get(k, defaults.get(k)) for k in want} == want:
            return data
        raise ValueError(f"{folder} holds data made by another recipe ({meta}); choose another --data folder.")
    t0 = time.perf_counter()
    if recipe.prompt_source == "self":  # short user turns (<= 64 tokens): every one leaves room for a response
        prompts = self_instruct_prompts(target, tokenizer, recipe.num_prompts, seed=recipe.train.seed,
                                        progress=bars and bars("writing prompts", recipe.num_prompts))  # fmt: skip
    else:
        prompts = stdlib_prompts()
    data = generate_examples(target, tokenizer, prompts, layers, seq_len=recipe.seq_len,
                             max_new_tokens=recipe.max_new_tokens, batch_size=recipe.gen_batch,
                             temperature=recipe.gen_temperature, limit=recipe.num_prompts,
                             progress=bars and bars("generating responses", recipe.num_prompts))  # fmt: skip
    meta = want | {"prompts": PROMPT_SOURCES[recipe.prompt_source], "seconds": time.perf_counter() - t0}
    write_shards(data, folder, meta)
    return data


def load_extra_data(folders, data: dict, meta_keys: dict) -> tuple[dict, list[dict]]:
    """``data`` joined with the prepared data sets in ``folders`` (made by earlier runs for the same
    model, feature layers and sequence length; refused otherwise). Returns (data, their metas)."""
    from jspec.eagle_data import load_shards

    parts, metas = [data], []
    for folder in folders:
        extra, meta = load_shards(pathlib.Path(folder))
        wrong = {k: meta.get(k) for k, v in meta_keys.items() if meta.get(k) != v}
        if wrong:
            raise ValueError(f"--extra-data {folder} was made for {wrong}, not {meta_keys}; it cannot join this data.")
        parts.append(extra)
        metas.append({k: v for k, v in meta.items() if k != "shards"} | {"folder": str(folder)})
    joined = {k: np.concatenate([p[k] for p in parts]) for k in ("tokens", "mask", "features", "top")}
    joined["counts"] = sum(p["counts"] for p in parts)
    return joined, metas


def train_head(target, tokenizer, recipe: Recipe, out_dir, *, model_name: str, data_dir=None, extra_data=(),
               progress: bool = True, until: int | None = None) -> tuple[DraftHead, dict]:  # fmt: skip
    """Data (made once), draft vocabulary, head, training with checkpoints (resumed when present), saved head.

    Args:
      extra_data: folders of data sets prepared by earlier runs, trained on beside ``data_dir``'s.

    Returns the head and a report: data size, per-step loss and accuracy at the end, seconds.
    """
    from jspec.eagle import DraftHead, HeadConfig, draft_vocabulary, load_head, save_head

    out_dir = pathlib.Path(out_dir)
    data_dir = pathlib.Path(data_dir) if data_dir else out_dir / "data"
    bar = _progress_bar(progress)
    t0 = time.perf_counter()
    data = prepare_data(target, tokenizer, recipe, data_dir, model_name, bars=bar)
    data_seconds = time.perf_counter() - t0
    config = HeadConfig.for_target(target.config, recipe.kind, recipe.draft_vocab, recipe.feature_layers)
    same = {"model": model_name, "feature_layers": list(config.feature_layers), "seq_len": recipe.seq_len}
    data, extra_metas = load_extra_data(extra_data, data, same)
    if recipe.init_from:  # fine-tuning keeps the starting head's draft vocabulary
        head = load_head(recipe.init_from, target)
        if head.config != config:
            raise ValueError(f"--init {recipe.init_from} holds a head made as {head.config}, not {config}; "
                             "match --kind, --draft-vocab and --feature-layers to it.")  # fmt: skip
        d2t = np.asarray(head.d2t[...])
    else:
        d2t = draft_vocabulary(data["counts"], recipe.draft_vocab)
        head = DraftHead(config, rngs=nnx.Rngs(recipe.train.seed))
        head.attach_target(target, d2t)
        if recipe.warm_start:
            head.warm_start(target)
    trainer = Trainer.for_target(head, target, recipe.train, out_dir / "checkpoints")
    resumed_from = trainer.step if trainer.restore() else None
    t1 = time.perf_counter()
    tick = bar("training", recipe.train.total_steps, start=trainer.step)
    history = trainer.fit(data, until=until, progress=tick, log_every=1)
    head = trainer.head()
    covered = float(data["counts"][d2t].sum() / max(data["counts"].sum(), 1))
    report = {
        "examples": len(data["tokens"]),
        "response_tokens": int(data["mask"].sum()),
        "extra_data": extra_metas,
        "draft_vocab_coverage": covered,
        "data_seconds": data_seconds,
        "train_seconds": time.perf_counter() - t1,
        "resumed_from": resumed_from,
        "steps": trainer.step,
        "final": history[-1] if history else None,
    }
    if trainer.step >= recipe.train.total_steps:
        recipe_dict = dataclasses.asdict(recipe) | {"model": model_name}
        save_head(head, out_dir, recipe=recipe_dict | {"report": report})
    return head, report


def _progress_bar(enabled: bool):
    """A factory of progress callbacks: tqdm bars on stderr, or nothing."""

    def make(desc, total, start=0):
        if not enabled:
            return None
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc=desc, leave=False)
        state = {"n": start}

        def update(n, info):
            bar.update(n - state["n"])
            state["n"] = n
            if isinstance(info, dict):
                loss = " ".join(f"{x:.2f}" for x in info["loss"])
                acc = " ".join(f"{x:.2f}" for x in info["acc"])
                bar.set_postfix_str(f"loss/step [{loss}] acc/step [{acc}]")
            if n >= total:
                bar.close()

        return update

    return make
