"""The model family on tiny random weights: cache equivalence, batching, masks, layer loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.core.cache import KVCache
from jspec.models.llama import Transformer
from jspec.models.loading import build_model
from jspec.models.tiny import tiny_config, tiny_model

ATOL = 1e-5  # float32 on CPU; set once for these tests


def _positions(b, start, t):
    return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_cached_decode_equals_full_forward(family, loop):
    model = tiny_model(family, loop)
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 97)
    full = model(toks, _positions(2, 0, 12), model.init_cache(2, 32))
    out = model(toks[:, :5], _positions(2, 0, 5), model.init_cache(2, 32))
    logits, cache = [out.logits], out.cache
    for t in range(5, 12):
        step = model(toks[:, t : t + 1], cache.lengths[:, None], cache)
        logits.append(step.logits)
        cache = step.cache
    np.testing.assert_allclose(jnp.concatenate(logits, 1), full.logits, atol=ATOL)
    assert cache.lengths.tolist() == [12, 12]


def test_negative_control_cache_off_by_one_position_differs():
    """The equivalence test can fail: feeding a wrong RoPE position changes the logits."""
    model = tiny_model()
    toks = jax.random.randint(jax.random.PRNGKey(1), (1, 6), 0, 97)
    full = model(toks, _positions(1, 0, 6), model.init_cache(1, 16))
    out = model(toks[:, :5], _positions(1, 0, 5), model.init_cache(1, 16))
    wrong = model(toks[:, 5:], out.cache.lengths[:, None] + 1, out.cache)
    assert np.abs(np.asarray(wrong.logits[:, 0] - full.logits[:, 5])).max() > 10 * ATOL


def _random_params(config, seed=0):
    """Checkpoint-style weights (separate q/k/v, gate/up), layers stacked [L, ...]."""
    rng = np.random.default_rng(seed)
    c = config
    L, H, F, D = c.num_layers, c.hidden_size, c.intermediate_size, c.head_dim
    qd, kvd = c.num_heads * D, c.num_kv_heads * D
    shapes = {
        "embed": (c.vocab_size, H), "final_norm": (H,), "lm_head": (c.vocab_size, H),
        "attn_norm": (L, H), "wq": (L, qd, H), "wk": (L, kvd, H), "wv": (L, kvd, H), "wo": (L, H, qd),
        "bq": (L, qd), "bk": (L, kvd), "bv": (L, kvd), "mlp_norm": (L, H),
        "w_gate": (L, F, H), "w_up": (L, F, H), "w_down": (L, H, F),
    }  # fmt: skip
    return {k: (0.1 * rng.standard_normal(v)).astype(np.float32) for k, v in shapes.items()}


def test_scan_and_unrolled_agree():
    config = tiny_config("qwen2")
    params = _random_params(config)
    unrolled = build_model(config, params, layer_loop="unrolled")
    scan = build_model(config, params, layer_loop="scan")
    toks = jax.random.randint(jax.random.PRNGKey(2), (2, 7), 0, 97)
    a = unrolled(toks, _positions(2, 0, 7), unrolled.init_cache(2, 16), hidden_layers=(0, 2))
    b = scan(toks, _positions(2, 0, 7), scan.init_cache(2, 16), hidden_layers=(0, 2))
    np.testing.assert_allclose(a.logits, b.logits, atol=ATOL)
    np.testing.assert_allclose(a.cache.k, b.cache.k, atol=ATOL)
    for x, y in zip(a.hidden_states, b.hidden_states, strict=True):
        np.testing.assert_allclose(x, y, atol=ATOL)


def test_an_unrolled_forward_traces_one_layer_whatever_its_depth(monkeypatch):
    """The unrolled loop's layers share one trace (each half of a layer is a jitted function): tracing a
    forward runs a layer's projections once, not once per layer. The agreement with the scanned loop,
    which runs :func:`decoder_layer` itself, is the test above."""
    from jspec.models import layers

    real, calls = layers.linear, []
    monkeypatch.setattr(layers, "linear", lambda x, w: calls.append(w.shape) or real(x, w))
    model = tiny_model("llama", num_layers=4, hidden_size=48)  # shapes no other test traces
    cache = model.init_cache(1, 16)
    jax.make_jaxpr(lambda t: model(t, _positions(1, 0, 3), cache).logits)(jnp.zeros((1, 3), jnp.int32))
    assert len(calls) == 4, calls  # q/k/v, o, gate/up and down, once; 16 when each layer is traced


def test_rows_of_different_lengths_match_each_row_alone():
    model = tiny_model("qwen2")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 97, n).tolist() for n in (3, 9, 6)]
    padded = np.zeros((3, 9), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    lengths = jnp.array([len(p) for p in prompts])
    out = model(
        jnp.asarray(padded),
        _positions(3, 0, 9),
        model.init_cache(3, 24),
        num_new=lengths,
        logit_index=lengths - 1,
    )
    assert out.cache.lengths.tolist() == [3, 9, 6]
    nxt = jnp.array([[5], [6], [7]])
    step = model(nxt, out.cache.lengths[:, None], out.cache)
    for i, p in enumerate(prompts):
        alone = model(jnp.array([p]), _positions(1, 0, len(p)), model.init_cache(1, 24))
        np.testing.assert_allclose(out.logits[i, 0], alone.logits[0, -1], atol=ATOL)
        one = model(nxt[i : i + 1], alone.cache.lengths[:, None], alone.cache)
        np.testing.assert_allclose(step.logits[i], one.logits[0], atol=ATOL)


def test_rollback_then_decode_matches_fresh_decode():
    model = tiny_model()
    toks = jax.random.randint(jax.random.PRNGKey(3), (1, 8), 0, 97)
    out = model(toks, _positions(1, 0, 8), model.init_cache(1, 16))
    rolled = out.cache.rollback(jnp.array([5]))  # reject the last three
    again = model(jnp.array([[11]]), rolled.lengths[:, None], rolled)
    fresh = model(toks[:, :5], _positions(1, 0, 5), model.init_cache(1, 16))
    ref = model(jnp.array([[11]]), fresh.cache.lengths[:, None], fresh.cache)
    np.testing.assert_allclose(again.logits, ref.logits, atol=ATOL)


def test_explicit_causal_mask_equals_default_and_mask_matters():
    model = tiny_model()
    toks = jax.random.randint(jax.random.PRNGKey(4), (1, 6), 0, 97)
    cache = model.init_cache(1, 8)
    default = model(toks, _positions(1, 0, 6), cache)
    explicit = model(toks, _positions(1, 0, 6), cache, cache.causal_mask(6))
    np.testing.assert_allclose(default.logits, explicit.logits, atol=ATOL)
    diagonal_only = jnp.eye(6, 8, dtype=bool)[None]
    other = model(toks, _positions(1, 0, 6), cache, diagonal_only)
    np.testing.assert_allclose(other.logits[:, 0], default.logits[:, 0], atol=ATOL)
    assert np.abs(np.asarray(other.logits[:, -1] - default.logits[:, -1])).max() > 1e-4


def test_causality_by_gradients():
    """The logits at position t do not depend on tokens after t (untied head, so only inputs count)."""
    model = tiny_model(tie_embeddings=False)
    toks = jnp.array([[5, 6, 7, 8, 9]])
    grads = nnx.grad(lambda m: m(toks, _positions(1, 0, 5), m.init_cache(1, 8)).logits[0, 2].sum())(model)
    per_token = np.abs(np.asarray(grads.embed[...])).sum(-1)
    assert per_token[[8, 9]].max() == 0.0
    assert per_token[[5, 6, 7]].min() > 0.0


def test_hidden_states_and_logits_head():
    model = tiny_model()
    toks = jnp.array([[1, 2, 3]])
    out = model(toks, _positions(1, 0, 3), model.init_cache(1, 4), hidden_layers=(2, 0))
    assert [h.shape for h in out.hidden_states] == [(1, 3, 32), (1, 3, 32)]
    np.testing.assert_allclose(model.logits(out.hidden_states[0]), out.logits, atol=ATOL)
    with pytest.raises(ValueError, match="hidden layer 3 out of range"):
        model(toks, _positions(1, 0, 3), model.init_cache(1, 4), hidden_layers=(3,))


def test_writes_past_capacity_are_dropped_not_clamped():
    model = tiny_model()
    cache = model.init_cache(1, 4).rollback(jnp.array([3]))
    out = model(jnp.array([[1, 2]]), _positions(1, 3, 2), cache)
    assert np.abs(np.asarray(out.cache.k[:, 0, 3])).max() > 0  # slot 3 written
    assert out.cache.lengths.tolist() == [5]


def test_config_errors():
    with pytest.raises(ValueError, match="unknown model family"):
        tiny_config("gpt")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config(num_kv_heads=3)
    with pytest.raises(ValueError, match="layer_loop"):
        Transformer(tiny_config(), rngs=nnx.Rngs(0), layer_loop="vmap")
    with pytest.raises(ValueError, match="capacity"):
        KVCache.create(1, 1, 0, 1, 1)


@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_bfloat16_weights_keep_bfloat16_caches_in_both_layer_loops(loop):
    """An accelerator's default (bfloat16 weights, scanned layers) traces: a float32 cache promoted the
    residual stream, which lax.scan refused as a carry and unrolled layers silently ran in float32."""
    from jspec.heads.eagle import DraftHead, HeadConfig

    model = Transformer(tiny_config(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16, layer_loop=loop)
    out = model(jnp.array([[5, 6, 7]]), _positions(1, 0, 3), model.init_cache(1, 8), hidden_layers=(0, 2))
    assert out.cache.k.dtype == out.cache.v.dtype == jnp.bfloat16
    assert all(h.dtype == jnp.bfloat16 for h in out.hidden_states) and out.logits.dtype == jnp.float32
    config = HeadConfig.for_target(model.config, "eagle3", draft_vocab_size=32, feature_layers=(0, 1, 2))
    head = DraftHead(config, rngs=nnx.Rngs(1), dtype=jnp.bfloat16)
    assert head.init_cache(1, 8).k.dtype == jnp.bfloat16
    assert model.init_cache(1, 8, jnp.float32).k.dtype == jnp.float32  # an explicit dtype still wins
