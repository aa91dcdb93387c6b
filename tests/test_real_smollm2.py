"""SmolLM2-135M-Instruct, the real model: loading, cache, generation, and parity with transformers."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import PARITY_RTOL, assert_greedy_matches, assert_logits_match, transformers_reference

from jspec.loop.decode import Decoder
from jspec.models.hub import ensure_gguf, load_model, verify_file
from jspec.models.loading import load_folder
from jspec.models.registry import get_source

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Speculative decoding drafts 12345 tokens,   then   verifies\n\nthem all!",
]


def test_config_and_tokenizer(smollm2):
    model, tok = smollm2
    c = model.config
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert c.tie_embeddings and c.vocab_size == 49152 and 2 in c.eos_token_ids
    assert tok.decode(tok.encode(TEXTS[2])) == TEXTS[2]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_cached_decode_equals_full_forward(smollm2):
    model, tok = smollm2
    ids = tok.encode(TEXTS[1])
    t = len(ids)
    full = model(jnp.array([ids]), jnp.arange(t)[None], model.init_cache(1, t + 4))
    out = model(jnp.array([ids[:-3]]), jnp.arange(t - 3)[None], model.init_cache(1, t + 4))
    cache, steps = out.cache, []
    for tok_id in ids[-3:]:
        step = model(jnp.array([[tok_id]]), cache.lengths[:, None], cache)
        cache = step.cache
        steps.append(np.asarray(step.logits[0, 0]))
    ref = np.asarray(full.logits[0, -3:])
    assert np.abs(np.stack(steps) - ref).max() / np.abs(ref).max() < PARITY_RTOL


def test_greedy_batch_rows_match_each_alone(smollm2):
    model, tok = smollm2
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in ("Name a fruit.", "2+2?")]
    decoder = Decoder(model, eos_ids=tok.eos_token_ids)
    batch = decoder.generate(prompts, 12)
    for prompt, row in zip(prompts, batch.tokens, strict=True):
        assert decoder.generate([prompt], 12).tokens[0] == row


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'.*smollm2-135m"):
        load_model("gpt-5")


def test_truncated_or_tampered_file_is_refused(tmp_path, monkeypatch, smollm2):
    real = ensure_gguf("smollm2-135m")
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    fake = tmp_path / "gguf" / "smollm2-135m.gguf"
    fake.parent.mkdir(parents=True)
    with open(real, "rb") as src, open(fake, "wb") as dst:
        dst.write(src.read(1_000_000))
    with pytest.raises(ValueError, match=r"smollm2-135m.gguf has 1000000 bytes.*truncated"):
        ensure_gguf("smollm2-135m")
    shutil.copyfile(real, fake)
    with open(fake, "r+b") as f:
        f.seek(5_000_000)
        f.write(b"\x00" * 16)
    with pytest.raises(ValueError, match="SHA-256"):
        verify_file(fake, get_source("smollm2-135m"))


def test_corrupt_safetensors_is_refused(tmp_path, smollm2):
    from jspec.models.hub import fetch

    src = fetch("smollm2-135m")
    dst = tmp_path / "model"
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    with open(src / "model.safetensors", "rb") as f, open(dst / "model.safetensors", "wb") as g:
        g.write(f.read(10_000_000))
    with pytest.raises(ValueError, match=r"model.safetensors is corrupt or truncated"):
        load_folder(dst)


def test_tokenizer_that_does_not_fit_the_weights(tmp_path, smollm2):
    from jspec.models.hub import fetch

    src = fetch("smollm2-135m")
    cfg = json.loads((src / "config.json").read_text()) | {"vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer has 49152 tokens but the model's embedding only 1000"):
        load_folder(tmp_path)


# ------------------------------------------------------------------ against transformers (PyTorch)


@pytest.fixture(scope="module")
def reference():
    return transformers_reference("smollm2-135m")


@pytest.mark.torch
def test_logits_match_transformers(smollm2, reference):
    assert_logits_match(*smollm2, reference, TEXTS)


@pytest.mark.torch
def test_chat_template_matches_transformers(smollm2, reference):
    _, ref_tok, _ = reference
    _, tok = smollm2
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert tok.apply_chat_template(messages) == ref_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.torch
def test_greedy_generation_matches_transformers(smollm2, reference):
    model, tok = smollm2
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a haiku about rivers."}]))
    assert_greedy_matches(model, tok, reference, ids, 24)


@pytest.mark.torch
def test_hugging_face_folder_gives_the_same_logits_and_tokens(tmp_path, smollm2, reference):
    """A real HF folder, written by transformers from the GGUF model, loads to the same model."""
    torch, ref_tok, ref_model = reference
    import transformers

    config = ref_model.config
    config.quantization_config = None
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(ref_model.state_dict())
    plain.save_pretrained(tmp_path)
    ref_tok.save_pretrained(tmp_path)
    hf_model, hf_tok = load_folder(tmp_path)
    model, tok = smollm2
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf_tok.encode(text) == ids
        cache = model.init_cache(1, len(ids))
        a = np.asarray(model(jnp.array([ids]), jnp.arange(len(ids))[None], cache).logits)
        b = np.asarray(hf_model(jnp.array([ids]), jnp.arange(len(ids))[None], cache).logits)
        assert np.abs(a - b).max() / np.abs(a).max() < PARITY_RTOL
    prompt = tok.encode(TEXTS[0])
    assert (
        Decoder(hf_model, eos_ids=hf_tok.eos_token_ids).generate([prompt], 8).tokens
        == Decoder(model, eos_ids=tok.eos_token_ids).generate([prompt], 8).tokens
    )


def test_prompt_lookup_greedy_equals_plain_greedy(smollm2):
    """Speculative greedy output is plain greedy output, token for token, on the real model."""
    from jspec.drafters import PromptLookup
    from jspec.loop.engine import SpeculativeDecoder

    model, tok = smollm2
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    questions = [f"Repeat this code and add a mul function:\n{code}", "List the days of the week."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    plain = Decoder(model, eos_ids=tok.eos_token_ids).generate(prompts, 48)
    spec = SpeculativeDecoder(model, PromptLookup(num_draft=4), eos_ids=tok.eos_token_ids)
    result = spec.generate(prompts, 48)
    assert result.tokens == plain.tokens
    assert result.verify_steps > 0 and result.tau > 1.0


def test_lookahead_greedy_equals_plain_greedy(smollm2):
    """Lookahead decoding on the real model, two rows of different lengths (a pool and a window each):
    plain greedy output, token for token, with candidates accepted."""
    from jspec.drafters import LookaheadDecoding
    from jspec.loop.engine import SpeculativeDecoder

    model, tok = smollm2
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    questions = [f"Repeat this code and add a mul function:\n{code}", "Count from one to twenty in words."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    plain = Decoder(model, eos_ids=tok.eos_token_ids).generate(prompts, 48)
    result = SpeculativeDecoder(model, LookaheadDecoding(), eos_ids=tok.eos_token_ids).generate(prompts, 48)
    assert result.tokens == plain.tokens
    assert sum(result.accept_hist[1:]) > 0


def test_auto_with_a_tuned_config_keeps_plain_greedy_output(smollm2):
    """--method auto on the real model: the tuned setting (prompt lookup, adaptive) runs and is exact."""
    from jspec import AutoDecoder, TunedConfig
    from jspec.tune.tuned import Recommendation, Setting

    model, tok = smollm2
    setting = Setting("ngram", num_draft=4, adaptive=True, costs=(1.4, 1.0))
    config = TunedConfig("smollm2-135m", model.config.vocab_size, "cpu", "cpu", "float32", {"prompts": "test"},
                         [Recommendation("greedy", 1, setting, 0.0, 1.2, 1.2)])  # fmt: skip
    auto = AutoDecoder(model, eos_ids=tok.eos_token_ids, config=config, model_name="smollm2-135m")
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat this code:\n{code}"}]))
    plain = Decoder(model, eos_ids=tok.eos_token_ids).generate([prompt], 40)
    result = auto.generate([prompt], 40)
    assert result.setting == setting.name and result.tokens == plain.tokens and result.verify_steps > 0
