"""Branches inside the generation loop that update big buffers (KV caches) in place.

``lax.cond`` and ``lax.switch`` copy the buffers their branches write: XLA gives a conditional's
branches their own output buffers, so a KV cache written in a branch is copied before the write and
again into the loop's carry after it (``experiments/costs/branch_copies.py`` counts the copies in the compiled
programs: several per step with ``lax.cond``, none with the forms here; docs/log, "The loops' branches
copied the KV caches"). A
``lax.while_loop`` updates its carry in place, so each branch here is a loop that runs zero times or
once: the same values, and the buffers stay where they are on every backend.

The branches take the carry and return a value of the same structure (shapes and dtypes); anything
else they need is closed over. Both branches are compiled, as with ``lax.cond``; only the taken one
runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp

__all__ = ["cond", "switch", "when"]

C = TypeVar("C")


def when(pred, fn: Callable[[C], C], carry: C) -> C:
    """``fn(carry)`` where the scalar ``pred`` holds, else ``carry`` unchanged."""
    once = lambda c: (jnp.zeros((), bool), fn(c[1]))  # noqa: E731
    return jax.lax.while_loop(lambda c: c[0], once, (jnp.asarray(pred, bool), carry))[1]


def cond(pred, true_fn: Callable[[C], C], false_fn: Callable[[C], C], carry: C) -> C:
    """``true_fn(carry)`` if the scalar ``pred`` holds, else ``false_fn(carry)``."""
    pred = jnp.asarray(pred, bool)
    return when(~pred, false_fn, when(pred, true_fn, carry))


def switch(index, branches: Sequence[Callable[[C], C]], carry: C) -> C:
    """``branches[index](carry)`` for a scalar int ``index``, clamped to [0, len(branches)) as
    ``lax.switch`` clamps it."""
    index = jnp.clip(jnp.asarray(index, jnp.int32), 0, len(branches) - 1)
    for i, fn in enumerate(branches):
        carry = when(index == i, fn, carry)
    return carry
