"""Qwen2.5-Coder-0.5B-Instruct against transformers: a slow test (a 491 MB download, 2.5 GB in float32)."""

import pytest
from conftest import assert_greedy_matches, assert_logits_match, transformers_reference

from jspec.loop.decode import Decoder
from jspec.models.hub import load_model

pytestmark = [pytest.mark.slow, pytest.mark.torch]

TEXTS = [
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "// Compute the n-th Fibonacci number in C\nint fib(int n) {",
]


@pytest.fixture(scope="module")
def qwen():
    return load_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def reference():
    return transformers_reference("qwen2.5-coder-0.5b")


def test_config(qwen):
    model, tok = qwen
    c = model.config
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "qwen2", 24, 896, 14, 2, 64,
    )  # fmt: skip
    assert c.qkv_bias and c.vocab_size == 151936 and c.rope_theta == 1e6
    assert tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]


def test_logits_and_tokens_match_transformers(qwen, reference):
    assert_logits_match(*qwen, reference, TEXTS)


def test_chat_template_and_greedy_generation_match(qwen, reference):
    _, ref_tok, _ = reference
    model, tok = qwen
    messages = [{"role": "user", "content": "Write a Python one-liner that sums a list."}]
    text = tok.apply_chat_template(messages)
    assert text == ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert_greedy_matches(model, tok, reference, tok.encode(text), 20)


def test_draft_model_greedy_equals_plain_greedy_on_the_qwen_pair():
    """Qwen2.5-Coder-0.5B drafting for 1.5B: speculative greedy output is plain greedy output."""
    from jspec.drafters import DraftModel
    from jspec.loop.engine import SpeculativeDecoder

    target, tok = load_model("qwen2.5-coder-1.5b")
    draft, _ = load_model("qwen2.5-coder-0.5b")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a Python function is_prime(n)."}]))
    plain = Decoder(target, eos_ids=tok.eos_token_ids).generate([ids], 24).tokens
    drafter = DraftModel.from_model(draft, target.config.vocab_size, num_draft=4)
    result = SpeculativeDecoder(target, drafter, eos_ids=tok.eos_token_ids).generate([ids], 24)
    assert result.tokens == plain
    assert result.tau > 1.5
