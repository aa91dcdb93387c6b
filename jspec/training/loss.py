"""The EAGLE heads' training objective: training-time test (TTT) and the loss.

Data is a set of fixed-length sequences with the target's hidden states already
computed (:mod:`jspec.training.data`): tokens int32[T], a loss mask (the response
tokens), the hidden states at the head's feature layers [T, n, H] and at the
target's top layer [T, H]. The target's distribution at a position is recomputed
from the top layer with the target's final norm and output rows for the draft
vocabulary (frozen copies), restricted to the draft vocabulary and renormalized.

Training-time test (EAGLE-3): the head runs ``num_steps`` steps; step 0 reads
the fused target features, step k > 0 reads the head's own outputs of step
k - 1 at the same rows and the tokens k positions further on. Row t of step k
predicts token t + k + 2 and attends to the context (step 0 rows <= t) and its
own earlier steps at row t (:func:`ttt_mask`). Step 0 runs on every row; the
later steps, the output layer and the loss run on each example's loss window
only, the rows whose predicted token is a response token (:func:`loss_window`;
the same loss, half the step time here). The loss is sum_k decay^k * CE_k.
EAGLE-1 (one step, no TTT) adds a smooth-L1 regression of the next top-layer
feature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.core.cache import KVCache
from jspec.heads.eagle import DraftHead
from jspec.models.layers import linear, rms_norm

__all__ = ["head_loss", "loss_window", "teacher_forced_agreement", "ttt_forward", "ttt_mask", "window_starts"]


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


def _rows(x, index, fill=0):
    """x[b, index[b, i]] for x [B, T, ...] and index int[B, W]; ``fill`` where the index is past T."""
    inside = index < x.shape[1]
    index = jnp.minimum(index, x.shape[1] - 1)
    got = jnp.take_along_axis(x, index.reshape(*index.shape, *([1] * (x.ndim - 2))), axis=1)
    return jnp.where(inside.reshape(*index.shape, *([1] * (x.ndim - 2))), got, jnp.asarray(fill, x.dtype))


def loss_window(mask, num_steps: int) -> int:
    """The fewest consecutive rows that hold every row with a loss at any TTT step, over a data set.

    Row r of step k has a loss when token r + k + 2 is a response token, so each example's loss
    rows lie within (the span from its first to its last response token + ``num_steps`` - 1)
    rows; a conversation's several assistant turns are one span with the user's turns inside
    (their rows are masked out of the loss). Steps after the first run on this window only, and
    every step's output layer and loss too. Rounded up to a multiple of 8 (fewer shapes to compile).

    Args:
      mask: bool[N, T], the response tokens of every example.
    """
    mask = np.asarray(mask, bool)
    t = mask.shape[1]
    first = mask.argmax(1)
    last = t - 1 - mask[:, ::-1].argmax(1)
    spans = np.where(mask.any(1), last - first + 1, 0)
    width = int(spans.max(initial=0)) + num_steps - 1
    return max(1, min(t - 1, -(-width // 8) * 8))


def window_starts(mask, num_steps: int, window: int | None) -> jax.Array:
    """int32[B]: each row's first window row (see :func:`loss_window`); zeros without a window."""
    b, t = mask.shape
    if window is None:
        return jnp.zeros((b,), jnp.int32)
    first = jnp.argmax(mask, axis=1).astype(jnp.int32)  # the first response token
    return jnp.clip(first - num_steps - 1, 0, t - 1 - window)


def token_counts(mask, num_steps: int, window: int | None) -> jax.Array:
    """float32[num_steps]: how many rows have a loss at each TTT step (Medusa: each head) in a batch, at
    least 1: the denominators of :func:`head_loss`'s and :func:`jspec.training.medusa.medusa_loss`'s means.

    Row r of step k has a loss when token r + k + 2 is a response token. A step that splits its batch
    into micro-batches passes the whole batch's counts to each, so that the micro-batches' losses
    add up to the whole batch's (gradient accumulation, exactly).
    """
    t = mask.shape[1]
    w = t - 1 if window is None else window
    rows = window_starts(mask, num_steps, window)[:, None] + jnp.arange(w)[None, :]
    valid = jnp.stack([_rows(mask, rows + k + 2, False) for k in range(num_steps)])  # [steps, B, W]
    return jnp.maximum(valid.sum((1, 2)), 1).astype(jnp.float32)


def ttt_forward(head: DraftHead, tokens, feature, num_steps: int, starts=None, window: int | None = None):
    """The head's outputs at each training-time-test step: a list of [B, W, H].

    Row r of step k reads token r + k + 1 at position r + k + 1 with the feature of
    step k - 1's row r (step 0: ``feature``, the fused target feature of token r),
    attends as :func:`ttt_mask` allows, and predicts token r + k + 2:
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
              regression_weight: float = 1.0, window: int | None = None, counts=None):  # fmt: skip
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
      counts: float32[num_steps], the means' denominators (:func:`token_counts`); default this batch's.
        A micro-batch of a larger batch takes the larger batch's: the micro-batches' losses then add up.

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
    dtype = head.fc[...].dtype  # the compute dtype (the trainer's bfloat16 copy, or float32)
    features = batch["features"].astype(dtype)
    top = batch["top"].astype(dtype)
    if head.config.kind == "eagle1":  # EAGLE-1 reads the top layer
        feature = head.fuse((top[:, :m],))
    else:
        feature = head.fuse(tuple(features[:, :m, i] for i in range(features.shape[2])))
    starts = window_starts(mask, num_steps, window)
    # The target's outputs at positions r + k + 1 of the window's rows r, every step k.
    ahead = starts[:, None] + 1 + jnp.arange(w + num_steps - 1)[None, :]
    top_ahead = _rows(top, ahead)
    target_logits = linear(rms_norm(top_ahead, target_norm, rms_eps), target_rows).astype(jnp.float32)
    target_logp = jax.nn.log_softmax(target_logits, axis=-1)
    mask_ahead = _rows(mask, ahead + 1, False)  # token r + k + 2 exists and is a response token
    total = jnp.float32(0.0)
    losses, accs = [], []
    for k, h in enumerate(ttt_forward(head, tokens, feature, num_steps, starts, window)):
        logp = jax.nn.log_softmax(head.logits(h), axis=-1)
        tgt = target_logp[:, k : k + w]
        valid = mask_ahead[:, k : k + w]
        ce = -jnp.sum(jnp.exp(tgt) * logp, axis=-1)
        count = jnp.maximum(valid.sum(), 1) if counts is None else counts[k]
        loss_k = jnp.sum(jnp.where(valid, ce, 0.0)) / count
        acc_k = jnp.sum(valid & (logp.argmax(-1) == tgt.argmax(-1))) / count
        if head.config.kind == "eagle1":
            nxt = top_ahead[:, k : k + w]  # the next top-layer feature, what EAGLE-1 regresses
            reg = jnp.sum(optax.huber_loss(h.astype(jnp.float32), nxt.astype(jnp.float32)).mean(-1) * valid) / count
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
