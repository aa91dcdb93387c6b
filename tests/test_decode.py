"""Plain decoding on a tiny random model: greedy equals a naive loop, batching, EOS, buckets, sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from stats_util import LEVEL, gof_p_value

from jspec.core.sampling import SamplingParams
from jspec.loop.batching import LoopConfig, batch_inputs, bucket, cache_slots
from jspec.loop.decode import Decoder, PlainLoop, decode_loop, jit_forward
from jspec.models.tiny import tiny_model


def _naive_greedy(model, prompt, steps, eos=(), width=32):
    """No cache: a full causal forward over the whole sequence for every new token.

    The sequence is padded to one width (causality makes the padding invisible)
    so that one compilation serves every step.
    """
    full = jax.jit(lambda toks: model(toks, jnp.arange(width)[None], model.init_cache(1, width)).logits[0])
    seq = list(prompt)
    out = []
    for _ in range(steps):
        t = len(seq)
        logits = full(jnp.array([seq + [0] * (width - t)]))[t - 1]
        nxt = int(jnp.argmax(logits))
        out.append(nxt)
        seq.append(nxt)
        if nxt in eos:
            break
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def test_greedy_batch_equals_naive_loop_per_row(model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 97, n).tolist() for n in (5, 11, 2)]
    decoder = Decoder(model, eos_ids=())
    result = decoder.generate(prompts, 12)
    for prompt, got in zip(prompts, result.tokens, strict=True):
        assert got == _naive_greedy(model, prompt, 12)
    assert result.target_calls == 12  # prefill + 11 single-token steps


def test_eos_and_budget_end_each_row_alone(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 97, n).tolist() for n in (4, 7)]
    ref = [_naive_greedy(model, p, 10) for p in prompts]
    eos = ref[0][3]  # row 0 stops at its 4th token; row 1 only if it emits the same id
    decoder = Decoder(model, eos_ids=(eos,))
    result = decoder.generate(prompts, 10)
    assert result.tokens[0] == ref[0][:4]
    want1 = ref[1][: ref[1].index(eos) + 1] if eos in ref[1] else ref[1]
    assert result.tokens[1] == want1
    short = decoder.generate(prompts, 3)
    assert [len(t) for t in short.tokens] == [3, 3]


def test_one_compilation_per_bucket(model):
    decoder = Decoder(model)
    decoder.generate([[5, 6, 7]], 5)
    decoder.generate([[5, 6, 7, 8, 9, 10]], 9)  # same buckets: 16 prompt, 16 new
    assert len(decoder._compiled) == 1
    decoder.generate([[5] * 20], 5)  # prompt bucket 32
    assert len(decoder._compiled) == 2
    assert bucket(1) == 16 and bucket(17) == 32


def test_a_process_keeps_at_most_max_compiled_loops_dropping_the_least_recently_used(model, monkeypatch):
    """A long-lived process serving many shapes must not grow without bound (each compiled SmolLM2 loop maps
    ~2,000 memory regions on CPU); a dropped shape compiles again and decodes the same."""
    monkeypatch.setenv("JSPEC_MAX_COMPILED", "2")
    a, b = Decoder(model), Decoder(model)
    first = a.generate([[5, 6, 7]], 5).tokens
    b.generate([[5, 6, 7]], 5)
    a.generate([[5, 6, 7]], 5)  # a's loop is now the most recently used
    b.generate([[5] * 20], 5)  # a third loop: b's first one, the least recently used, is dropped
    assert len(a._compiled) == 1 and len(b._compiled) == 1 and ((1, _a_loop(a)),) == tuple(a._compiled)
    again = b.generate([[5, 6, 7]], 5)
    assert again.compile_seconds > 0.05 and again.tokens == first  # compiled anew; a's loop dropped in turn
    assert len(a._compiled) + len(b._compiled) == 2 and not a._compiled
    monkeypatch.setenv("JSPEC_MAX_COMPILED", "0")
    with pytest.raises(ValueError, match="JSPEC_MAX_COMPILED"):
        a.generate([[5, 6, 7]], 5)


def _a_loop(decoder):
    ((_, loop),) = decoder._compiled
    return loop


def test_the_cache_holds_each_prompt_and_budget_and_no_more(model):
    """Prompt and budget buckets of 32 + 64 slots; 20 + 40 tokens need 64 (one bucket)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 97, n).tolist() for n in (20, 9)]
    decoder = Decoder(model)
    result = decoder.generate(prompts, 40)
    ((_, loop),) = decoder._compiled
    config = loop.config
    assert (config.prompt_len, config.max_new, config.capacity()) == (32, 64, 64)
    for prompt, got in zip(prompts, result.tokens, strict=True):
        assert got == _naive_greedy(model, prompt, 40, width=64)
    assert cache_slots(16, 16, 3, 5) == 16 and cache_slots(128, 64, 100, 64) == 192  # never above P + M
    # Negative control: 8 slots fewer drop the last keys of row 0 (20 + 40 tokens) and change its output.
    batch = batch_inputs(prompts, 40, None, None)
    assert batch.cache_len == 64
    graphdef, state = nnx.split(model)
    short = PlainLoop(graphdef, LoopConfig(32, 64, (), cache_len=56))
    tokens, _, _ = decode_loop(short, state, *batch.arrays())
    assert np.asarray(tokens)[0, :40].tolist() != result.tokens[0]


def test_sampled_first_token_follows_the_model_distribution(model):
    prompt = [7, 8, 9, 10]
    logits = model(jnp.array([prompt]), jnp.arange(4)[None], model.init_cache(1, 4)).logits[0, -1]
    probs = np.asarray(jax.nn.softmax(logits), np.float64)
    result = Decoder(model).generate([prompt] * 4000, 1, SamplingParams.create(temperature=1.0), seed=3)
    counts = np.bincount([t[0] for t in result.tokens], minlength=probs.size)
    assert gof_p_value(counts, probs) > LEVEL
    assert gof_p_value(counts, np.roll(probs, 1)) < LEVEL  # negative control: a shifted distribution


def test_bad_input(model):
    decoder = Decoder(model)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decoder.generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match=r"prompt 0 has 250 tokens.*260 cache slots.*holds 256"):
        decoder.generate([[1] * 250], 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.generate([[1, 200]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate([[1]], 0)


def test_jit_forward_donates_the_cache_and_matches_the_model():
    model = tiny_model("llama")
    state, forward = jit_forward(model)
    cache = model.init_cache(1, 16)
    tokens = jnp.array([[3, 5, 7]], jnp.int32)
    positions = jnp.arange(3, dtype=jnp.int32)[None, :]
    expected = model(tokens, positions, model.init_cache(1, 16)).logits
    logits, new_cache = forward(state, tokens, positions, cache)
    np.testing.assert_allclose(logits, expected, atol=1e-5)
    assert int(new_cache.lengths[0]) == 3
    assert cache.k.is_deleted() and cache.v.is_deleted()  # donated: XLA reused the buffers
    assert not new_cache.k.is_deleted()
