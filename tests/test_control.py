"""jspec.loop.control: branches that give lax.cond's values without copying the buffers they write."""

import jax
import jax.numpy as jnp
import numpy as np
from experiment import load_experiment

from jspec.core.sampling import SamplingParams
from jspec.loop import control
from jspec.models.tiny import tiny_model

_EXPERIMENT = load_experiment("branch_copies")


def cache_copies(hlo: str, layers: int, rows: int, kv_heads: int, head_dim: int) -> int:
    """Copies of a whole [layers, rows, capacity, kv_heads, head_dim] cache inside the loop and its branches
    (experiments/costs/branch_copies.py counts them)."""
    shape = lambda d: len(d) == 5 and [d[0], d[1], d[3], d[4]] == [layers, rows, kv_heads, head_dim] and d[2] > 8  # noqa: E731
    return _EXPERIMENT.copies_in_loop(hlo, shape)


def test_branches_give_lax_cond_s_values():
    carry = (jnp.arange(4.0), {"n": jnp.int32(3)})
    inc = lambda c: (c[0] + 1, {"n": c[1]["n"] + 1})  # noqa: E731
    dbl = lambda c: (c[0] * 2, {"n": c[1]["n"] * 2})  # noqa: E731
    neg = lambda c: (-c[0], {"n": -c[1]["n"]})  # noqa: E731

    @jax.jit
    def both(pred, index):
        return (control.cond(pred, inc, dbl, carry), jax.lax.cond(pred, inc, dbl, carry),
                control.switch(index, [inc, dbl, neg], carry), jax.lax.switch(index, [inc, dbl, neg], carry),
                control.when(pred, neg, carry))  # fmt: skip

    for pred, index in ((True, 0), (False, 1), (True, 2), (False, 7), (True, -3)):  # out of range: clamped
        ours, theirs, ours_s, theirs_s, when = both(pred, index)
        jax.tree.map(np.testing.assert_array_equal, ours, theirs)
        jax.tree.map(np.testing.assert_array_equal, ours_s, theirs_s)
        jax.tree.map(np.testing.assert_array_equal, when, neg(carry) if pred else carry)


def _loop(branch):
    """A loop whose step writes one slot per row of a cache in one of two branches, then reads it."""
    layers, rows, cap, heads, dim = 3, 2, 16, 2, 4

    def run(cache, q):
        def body(s):
            i, cache, acc = s
            pos = (i + jnp.arange(rows)) % cap
            write = lambda c, v: c.at[:, jnp.arange(rows), pos].set(v)  # noqa: E731
            cache = branch(i % 3 == 0, lambda c: write(c, 1.0), lambda c: write(write(c, 2.0), 3.0), cache)
            return i + 1, cache, acc + jnp.einsum("lbshd,bd->b", cache, q)

        return jax.lax.while_loop(lambda s: s[0] < 10, body, (0, cache, jnp.zeros(rows)))

    args = jnp.zeros((layers, rows, cap, heads, dim)), jnp.ones((rows, dim))
    hlo = jax.jit(run, donate_argnums=0).lower(*args).compile().as_text()
    return cache_copies(hlo, layers, rows, heads, dim), run(*args)


def test_a_branch_that_writes_a_cache_does_not_copy_it_with_negative_control():
    ours, out = _loop(control.cond)
    theirs, expected = _loop(lambda pred, t, f, c: jax.lax.cond(pred, t, f, c))
    assert ours == 0
    assert theirs > 0  # the negative control: XLA's conditional copies the cache it writes
    jax.tree.map(np.testing.assert_array_equal, out, expected)


def test_the_speculative_loop_keeps_the_target_s_cache_in_place_with_negative_control(monkeypatch):
    """The compiled prompt-lookup loop of a tiny target has no copy of the target's KV cache per step;
    with lax.cond in the engine's branches it has (the negative control)."""
    import jspec.loop.engine
    from jspec.drafters import PromptLookup

    target = tiny_model(num_layers=3)
    c = target.config

    def copies():
        decoder = jspec.loop.engine.SpeculativeDecoder(target, PromptLookup(num_draft=3), eos_ids=(3,))
        out = decoder.generate([[5, 6, 7, 5, 6, 7, 5, 6]] * 2, 12, SamplingParams.greedy())
        hlo = next(iter(decoder._compiled.values())).whole.as_text()
        return cache_copies(hlo, c.num_layers, 2, c.num_kv_heads, c.head_dim), out.tokens

    ours, tokens = copies()
    jax.clear_caches()
    monkeypatch.setattr(jspec.loop.engine, "cond", lambda pred, t, f, s: jax.lax.cond(pred, t, f, s))
    theirs, expected = copies()
    assert ours == 0 and theirs > 0 and tokens == expected
