"""Medusa heads (Cai et al. 2024): extra decoding heads on the target's last hidden state.

Head k (k = 1 … K) reads the target's final hidden state at token t, the one from which the
target itself predicts token t + 1, and predicts token t + 1 + k: a residual block
``h + SiLU(W_k h + b_k)`` on the normalized state, then the target's own output layer (tied: a
frozen copy, never trained, never saved). W_k starts at zero, so an untrained head k repeats the
target's next-token prediction. No attention, no cache, no training-time test: cheaper to train
than EAGLE, and its drafts at different depths do not see each other (so they agree less).

The drafter that runs the heads is :class:`jspec.drafters.MedusaDrafter`; training is
:func:`jspec.training.medusa.medusa_loss` in the same pipeline as the EAGLE heads.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jspec.files import atomic_write, write_text
from jspec.heads.eagle import Frozen, read_tensors
from jspec.models.layers import linear, rms_norm

__all__ = ["MedusaConfig", "MedusaHeads", "load_medusa", "save_medusa", "saved_rank_rates"]

WEIGHTS, META = "medusa.safetensors", "medusa.json"


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """num_heads: K. hidden_size, vocab_size, rms_eps: the target's. num_target_layers: the target's
    layer count (the heads read its last layer's output)."""

    num_heads: int
    hidden_size: int
    vocab_size: int
    rms_eps: float
    num_target_layers: int
    untied: bool = False  # each head its own output layer (Medusa-1's published heads), not the target's

    def __post_init__(self):
        if self.num_heads < 1:
            raise ValueError(f"a Medusa model needs at least one head; got num_heads={self.num_heads}.")

    @classmethod
    def for_target(cls, target, num_heads: int = 4) -> MedusaConfig:
        """Heads shaped for a target :class:`jspec.models.config.ModelConfig`."""
        return cls(int(num_heads), target.hidden_size, target.vocab_size, target.rms_eps, target.num_layers)

    @property
    def hidden_layer(self) -> int:
        return self.num_target_layers - 1


class MedusaHeads(nnx.Module):
    """K Medusa heads; call :meth:`attach_target` before use (the output layer and final norm)."""

    def __init__(self, config: MedusaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        del rngs  # the blocks start at zero (Medusa's initialisation): each head repeats the target at first
        c = config
        self.config = c
        self.w = nnx.Param(jnp.zeros((c.num_heads, c.hidden_size, c.hidden_size), dtype))
        self.b = nnx.Param(jnp.zeros((c.num_heads, c.hidden_size), dtype))
        self.final_norm = Frozen(jnp.ones((c.hidden_size,), dtype))
        self.lm_head = Frozen(jnp.zeros((c.vocab_size, c.hidden_size), dtype))
        # Untied: head k's own output layer [K, V, H], read from its file (jspec.heads.formats), never trained here.
        self.head_out = Frozen(jnp.zeros((c.num_heads, c.vocab_size, c.hidden_size), dtype)) if c.untied else None

    def attach_target(self, target) -> None:
        """Copies the target's final norm (as a plain RMSNorm weight) and output layer into the heads."""
        t = target.config
        if (t.hidden_size, t.vocab_size, t.num_layers) != (
            self.config.hidden_size,
            self.config.vocab_size,
            self.config.num_target_layers,
        ):
            raise ValueError(
                f"these Medusa heads were built for hidden {self.config.hidden_size}, vocabulary "
                f"{self.config.vocab_size} and {self.config.num_target_layers} layers; the target has "
                f"{t.hidden_size}, {t.vocab_size} and {t.num_layers}. Train heads for this target."
            )
        self.final_norm[...] = target.final_norm_weight()
        self.lm_head[...] = target.output_weights()

    def states(self, hidden: jax.Array) -> jax.Array:
        """[..., H] (the target's last layer output, before its final norm) → [..., K, H]."""
        h = rms_norm(hidden, self.final_norm[...], self.config.rms_eps)
        b = self.b[...].reshape((1,) * (h.ndim - 1) + self.b[...].shape)  # explicit: rank promotion stays off
        pre = jnp.einsum("...h,koh->...ko", h, self.w[...]) + b
        return h[..., None, :] + jax.nn.silu(pre)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., H] → float32[..., K, V]: head k's logits for the token k + 1 after the target's next."""
        if self.config.untied:
            return jnp.einsum("...kh,kvh->...kv", self.states(hidden), self.head_out[...]).astype(jnp.float32)
        return linear(self.states(hidden), self.lm_head[...]).astype(jnp.float32)


def save_medusa(heads: MedusaHeads, folder, recipe: dict | None = None) -> pathlib.Path:
    """Writes the trained blocks (float16) to ``medusa.safetensors`` and the config and recipe to
    ``medusa.json`` (the output layer is the target's and is not written); atomically per file."""

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"w": np.asarray(heads.w[...], np.float16), "b": np.asarray(heads.b[...], np.float16)}
    if heads.config.untied:  # the heads' own output layers travel with them
        tensors["head_out"] = np.asarray(heads.head_out[...], np.float16)
    with atomic_write(folder / WEIGHTS) as tmp:
        save_file(tensors, str(tmp))
    meta = {"kind": "medusa", "config": dataclasses.asdict(heads.config), "recipe": recipe or {}}
    write_text(folder / META, json.dumps(meta, indent=1))
    return folder


def load_medusa(folder, target) -> MedusaHeads:
    """Heads saved by :func:`save_medusa`, attached to ``target``; refuses another kind of file, a
    damaged one, or heads made for another target."""

    folder = pathlib.Path(folder)
    if not (folder / META).exists() or not (folder / WEIGHTS).exists():
        other = " (it holds an EAGLE head: use method eagle3 or eagle1)" if (folder / "head.json").exists() else ""
        raise ValueError(f"{folder} does not hold Medusa heads ({META} and {WEIGHTS}){other}.")
    try:
        meta = json.loads((folder / META).read_text())
        config = MedusaConfig(**meta["config"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{folder / META} is not a Medusa config ({err}); refusing it.") from err
    if meta.get("kind") != "medusa":
        raise ValueError(f"{folder / META} describes a {meta.get('kind')!r}, not Medusa heads.")
    heads = MedusaHeads(config, rngs=nnx.Rngs(0))
    tensors = read_tensors(folder / WEIGHTS)
    for name in ("w", "b", "head_out") if config.untied else ("w", "b"):
        want = getattr(heads, name)[...].shape
        if name not in tensors or tensors[name].shape != want:
            raise ValueError(f"{folder / WEIGHTS}: tensor {name!r} is missing or not {want}; refusing it.")
        getattr(heads, name)[...] = jnp.asarray(tensors[name], jnp.float32)
    heads.attach_target(target)
    return heads


def saved_rank_rates(folder):
    """The rank rates ``jspec train medusa`` measured on held-out data and saved with the heads
    (``medusa.json``: ``recipe.report.rank_rates``); a clear error when the folder has none."""
    folder = pathlib.Path(folder)
    try:
        rates = json.loads((folder / META).read_text())["recipe"]["report"]["rank_rates"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{folder} holds no measured rank rates ({type(err).__name__}: {err}); train the heads "
                         "with jspec train medusa, or pass rates= or a branching such as 3,2,1.") from err  # fmt: skip
    return np.asarray(rates, np.float64)
