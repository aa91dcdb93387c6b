"""The Medusa loss: each head's cross-entropy on the token it predicts, heads weighted by a decay.

Row r holds the target's last-layer output after token r; head k (0-based) predicts token
r + k + 2 there, which has a loss when it is a response token. Those rows are the ones
:func:`jspec.training.loss.loss_window` finds for ``num_steps = K``, so the loss runs on that
window only. Each head's output layer (V wide) is recomputed in the backward pass rather than
stored (``jax.checkpoint``): K copies of [B, W, V] logits would not fit on a small machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.heads.medusa import MedusaHeads
from jspec.models.layers import linear
from jspec.training.loss import _rows, window_starts

__all__ = ["medusa_loss", "rank_rates"]


def medusa_loss(heads: MedusaHeads, batch: dict, decay: float, window: int | None = None, counts=None):
    """(weighted loss, {"loss": [K], "acc": [K]}): head k's mean cross-entropy and top-1 agreement with
    the data's token (the target's own response), weighted by ``decay ** k`` (Medusa's λ_k).

    Args:
      batch: ``tokens`` int32[B, T], ``mask`` bool[B, T] (response tokens), ``top`` [B, T, H]
        (the target's last layer output).
      window: rows per example with a loss (:func:`jspec.training.loss.loss_window` with K), or
        None for every row.
      counts: float32[K], the means' denominators (:func:`jspec.training.loss.token_counts`); default
        this batch's.
    """
    tokens, mask = batch["tokens"], batch["mask"]
    k = heads.config.num_heads
    t = tokens.shape[1]
    w = t - 1 if window is None else window
    starts = window_starts(mask, k, window)
    rows = starts[:, None] + jnp.arange(w)[None, :]  # [B, W]
    states = heads.states(_rows(batch["top"].astype(heads.lm_head[...].dtype), rows))  # [B, W, K, H]
    lm_head = heads.lm_head[...]

    @jax.checkpoint
    def head_terms(state, target, valid, count):
        logits = linear(state, lm_head).astype(jnp.float32)  # [B, W, V]
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        count = jnp.maximum(valid.sum(), 1) if count is None else count
        hit = (jnp.argmax(logits, axis=-1) == target) & valid
        return jnp.sum(nll * valid) / count, hit.sum() / count

    losses, accs = [], []
    for i in range(k):
        ahead = rows + i + 2
        count = None if counts is None else counts[i]
        loss, acc = head_terms(states[:, :, i], _rows(tokens, ahead), _rows(mask, ahead, False), count)
        losses.append(loss)
        accs.append(acc)
    losses, accs = jnp.stack(losses), jnp.stack(accs)
    total = jnp.sum(losses * decay ** jnp.arange(k, dtype=jnp.float32))
    return total, {"loss": losses, "acc": accs}


def rank_rates(heads: MedusaHeads, data: dict, width: int = 8, chunk: int = 4) -> np.ndarray:
    """float[K, width]: how often head k's i-th most likely token is the data's token (the target's own).

    The ranks are disjoint events, so ``rates[k, :j].sum()`` is how often a Medusa tree node with
    j children at depth k + 1 holds the target's token: what :func:`jspec.drafters.medusa.best_branching`
    chooses a tree from. ``data`` as in :func:`medusa_loss` (host arrays, any number of examples,
    read ``chunk`` at a time); every row with a response token ahead counts.
    """
    k = heads.config.num_heads
    hits, count = np.zeros((k, width)), np.zeros(k)
    lm_head = heads.lm_head[...]
    for lo in range(0, len(data["tokens"]), chunk):
        tokens, mask = (jnp.asarray(data[name][lo : lo + chunk]) for name in ("tokens", "mask"))
        rows = jnp.broadcast_to(jnp.arange(tokens.shape[1] - 1)[None], (tokens.shape[0], tokens.shape[1] - 1))
        states = heads.states(jnp.asarray(data["top"][lo : lo + chunk], jnp.float32)[:, :-1])  # [b, T-1, K, H]
        for i in range(k):
            _, top = jax.lax.top_k(linear(states[:, :, i], lm_head).astype(jnp.float32), width)
            target, valid = _rows(tokens, rows + i + 2), _rows(mask, rows + i + 2, False)
            hits[i] += np.asarray(((top == target[..., None]) & valid[..., None]).sum((0, 1)))
            count[i] += float(valid.sum())
    return hits / np.maximum(count, 1)[:, None]
