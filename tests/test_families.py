"""Llama 3.x, Qwen3 and Gemma 3 against transformers: tiny random models that transformers writes here.

Each model is built by transformers from a small config (its parameters perturbed so that no norm
is the identity), saved with ``save_pretrained`` beside a small word-level tokenizer, and loaded by
jspec's own loader. Logits must match transformers' within the parity tolerance, and greedy tokens
(plain and speculative with prompt lookup) must equal transformers' ``generate``, past Gemma's
sliding window.
"""

import json

import numpy as np
import pytest
from conftest import PARITY_RTOL

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_hf import COMMON, FAMILIES, GEMMA_TEMPLATE, WINDOW, write_family, write_tokenizer  # noqa: E402


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    from jspec.models.loading import load_folder

    folder = tmp_path_factory.mktemp(request.param)
    reference = write_family(folder, request.param)
    model, tok = load_folder(folder, layer_loop="unrolled")
    return request.param, folder, reference, model, tok


IDS = [2, 9, 17, 30, 9, 17, 30, 41, 12, 55, 9, 17, 30, 8, 21, 33, 47, 9, 17, 30, 41, 60, 13, 9]


def _reference_logits(reference, ids):
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].numpy()


def test_family_logits_match_transformers(family):
    import jax.numpy as jnp

    name, _, reference, model, _ = family
    want = _reference_logits(reference, IDS)
    cache = model.init_cache(1, len(IDS))
    got = np.asarray(model(jnp.array([IDS]), jnp.arange(len(IDS))[None], cache).logits[0])
    assert np.abs(got - want).max() / np.abs(want).max() < PARITY_RTOL, name
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_family_greedy_and_speculative_equal_transformers(family):
    """32 greedy tokens from a 24-token prompt (Gemma's window is 5): transformers' generate, jspec's
    plain loop and prompt lookup all agree token for token."""
    from jspec.drafters import PromptLookup
    from jspec.loop.decode import Decoder
    from jspec.loop.engine import SpeculativeDecoder

    name, _, reference, model, _ = family
    with torch.no_grad():
        out = reference.generate(torch.tensor([IDS]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
    want = out[0, len(IDS) :].tolist()
    assert len(set(want)) > 8  # a varied continuation, not a fixed point that any mask would reproduce
    assert Decoder(model).generate([IDS], 32).tokens[0] == want, name
    spec = SpeculativeDecoder(model, PromptLookup(num_draft=4, max_ngram=2)).generate([IDS], 32)
    assert spec.tokens[0] == want, name


def test_family_scan_equals_unrolled(family):
    """The scanned layer loop (accelerators) carries each layer's RoPE base and window as the unrolled one."""
    import jax.numpy as jnp

    from jspec.models.loading import load_folder

    name, folder, _, model, _ = family
    scanned, _ = load_folder(folder, layer_loop="scan")
    args = (jnp.array([IDS]), jnp.arange(len(IDS))[None])
    a = model(*args, model.init_cache(1, len(IDS))).logits
    b = scanned(*args, scanned.init_cache(1, len(IDS))).logits
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def gemma97(tmp_path_factory):
    """Gemma 3 with the vocabulary of the tree tests' oracle (97) and a window of 2, narrower than the trees."""
    from jspec.models.loading import load_folder

    folder = tmp_path_factory.mktemp("gemma97")
    write_family(folder, "gemma3", vocab_size=97, sliding_window=2)
    return load_folder(folder, layer_loop="unrolled")[0]


def test_gemma_trees_past_the_window_keep_greedy_output(gemma97):
    """Tree verification on sliding layers: the nodes' keys carry their depths' positions, and the
    accepted path moved into place is seen through the window like any committed token."""
    from test_tree_engine import PROMPTS, OracleTree, _head, _oracle

    from jspec.core.tree import DynamicTreeSpec
    from jspec.drafters import EagleDrafter
    from jspec.loop.decode import Decoder
    from jspec.loop.engine import SpeculativeDecoder

    plain = Decoder(gemma97).generate(PROMPTS, 20).tokens
    assert all(len(set(t)) > 8 for t in plain)
    got = SpeculativeDecoder(gemma97, OracleTree(_oracle(PROMPTS, plain))).generate(PROMPTS, 20)
    assert got.tokens == plain and got.accept_hist[-1] == sum(got.accept_hist)
    drafter = EagleDrafter.from_head(_head(gemma97), gemma97, tree=DynamicTreeSpec(top_k=4, depth=3, total=12))
    assert SpeculativeDecoder(gemma97, drafter).generate(PROMPTS, 20).tokens == plain


def test_sliding_window_is_what_gemma_needs(tmp_path):
    """Negative control: with the window widened past the prompt the logits beyond it no longer match,
    and within the window they still do, so the parity test above does test the window."""
    import dataclasses

    import jax.numpy as jnp

    from jspec.models.loading import load_folder

    reference = write_family(tmp_path, "gemma3")
    model, _ = load_folder(tmp_path, layer_loop="unrolled")
    model.config = dataclasses.replace(model.config, sliding_window=100)
    want = _reference_logits(reference, IDS)
    got = np.asarray(model(jnp.array([IDS]), jnp.arange(len(IDS))[None], model.init_cache(1, len(IDS))).logits[0])
    err = np.abs(got - want).max(-1) / np.abs(want).max()
    assert err[:WINDOW].max() < PARITY_RTOL and err[WINDOW:].max() > 100 * PARITY_RTOL


def test_llama3_rope_scaling_is_not_ignored(tmp_path):
    """Negative control for the defect: the same weights decoded with plain RoPE differ from transformers."""
    import dataclasses

    import jax.numpy as jnp

    from jspec.models.loading import load_folder

    reference = write_family(tmp_path, "llama3")
    model, _ = load_folder(tmp_path, layer_loop="unrolled")
    assert model.config.rope_scaling is not None and model.config.rope_scaling.kind == "llama3"
    model.config = dataclasses.replace(model.config, rope_scaling=None)
    want = _reference_logits(reference, IDS)
    got = np.asarray(model(jnp.array([IDS]), jnp.arange(len(IDS))[None], model.init_cache(1, len(IDS))).logits[0])
    assert np.abs(got - want).max() / np.abs(want).max() > 100 * PARITY_RTOL


def test_gemma_chat_template_and_bos(tmp_path):
    from jspec.models.tokenizer import TextTokenizer

    write_tokenizer(tmp_path, GEMMA_TEMPLATE)
    tok = TextTokenizer.load(tmp_path)
    text = tok.apply_chat_template([{"role": "user", "content": " w9 w10 "}])
    assert text == "<bos><start_of_turn>user\nw9 w10<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text)
    assert ids[0] == 2 and ids[1] != 2  # one BOS: the template's, not a second one from add_bos_token
    assert tok.encode("w9")[0] == 2


# ---------------------------------------------------------------------- refused configs and folders


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_parameters.rope_type"),
        ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
        ("use_sliding_window", True, "use_sliding_window"),
        ("mlp_bias", True, "mlp_bias"),
        ("hidden_act", "gelu", "hidden_act"),
        ("some_future_switch", 3, "some_future_switch"),
    ],
)
def test_config_fields_jspec_does_not_implement_are_refused(field, value, needle):
    from jspec.models.config import ModelConfig

    cfg = {"model_type": "qwen3", "hidden_act": "silu", **COMMON, field: value}
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf(cfg)


def test_old_config_spellings_read_the_same():
    """transformers 4.x wrote rope_theta / rope_scaling / rope_local_base_freq / sliding_window_pattern."""
    from jspec.models.config import ModelConfig

    old = {"model_type": "gemma3_text", **COMMON, "num_hidden_layers": 6, "rope_theta": 1e6, "sliding_window": 4,
           "rope_local_base_freq": 1e4, "sliding_window_pattern": 6, "query_pre_attn_scalar": 16,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0},
           "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
    c = ModelConfig.from_hf(old)
    assert c.layer_types == ("sliding",) * 5 + ("full",) and c.rope_scaling.factor == 8.0
    np.testing.assert_allclose(c.inv_freq(5), 1e6 ** -(np.arange(0, 8, 2) / 8) / 8, rtol=1e-6)
    np.testing.assert_allclose(c.inv_freq(0), 1e4 ** -(np.arange(0, 8, 2) / 8), rtol=1e-6)


def test_unsupported_architecture_names_the_supported_ones():
    from jspec.models.config import ModelConfig

    with pytest.raises(ValueError, match=r"MistralForCausalLM.*Gemma3ForCausalLM"):
        ModelConfig.from_hf({"model_type": "mistral", "architectures": ["MistralForCausalLM"], **COMMON})


def _sharded(tmp_path, family="qwen3"):
    """The family's tiny model saved by transformers as several shards with their index."""
    write_family(tmp_path, family).save_pretrained(tmp_path, max_shard_size="20KB")
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 3
    return weight_map


def test_sharded_folder_loads_and_refuses_missing_or_mismatched_shards(tmp_path):
    import jax.numpy as jnp

    from jspec.models.loading import load_folder

    weight_map = _sharded(tmp_path)
    model, _ = load_folder(tmp_path, layer_loop="unrolled")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    want = _reference_logits(reference, IDS)
    got = np.asarray(model(jnp.array([IDS]), jnp.arange(len(IDS))[None], model.init_cache(1, len(IDS))).logits[0])
    assert np.abs(got - want).max() / np.abs(want).max() < PARITY_RTOL

    index = tmp_path / "model.safetensors.index.json"
    shards = sorted(set(weight_map.values()))
    moved = next(n for n in weight_map if weight_map[n] == shards[0])
    index.write_text(json.dumps({"weight_map": weight_map | {moved: shards[1]}}))
    with pytest.raises(ValueError, match="do not match the index"):
        load_folder(tmp_path)
    index.write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / shards[-1]).unlink()
    with pytest.raises(ValueError, match=f"misses shard {shards[-1]}"):
        load_folder(tmp_path)


def test_bfloat16_folder_and_dtype_choice(tmp_path):
    import jax.numpy as jnp

    from jspec.models.loading import load_folder

    reference = write_family(tmp_path, "gemma3", tie_word_embeddings=True)  # as the real ones: tied
    reference.to(torch.bfloat16).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert (raw.get("dtype") or raw.get("torch_dtype")) == "bfloat16"
    f32, _ = load_folder(tmp_path)  # CPU default: float32 (bfloat16 is several times slower here)
    bf16, _ = load_folder(tmp_path, dtype="bfloat16")
    assert f32.embed[...].dtype == jnp.float32 and bf16.embed[...].dtype == jnp.bfloat16 and f32.lm_head is None
    np.testing.assert_array_equal(np.asarray(f32.embed[...]), np.asarray(bf16.embed[...], np.float32))
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        load_folder(tmp_path, dtype="float16")


def test_default_dtype_is_float32_on_cpu_and_bfloat16_on_an_accelerator(monkeypatch):
    """A float32 folder (a dequantized GGUF) on a GPU or TPU is held in bfloat16 unless float32 is asked for."""
    import jax
    import jax.numpy as jnp

    import jspec.models.loading as loading

    assert loading.resolve_dtype(None) == jnp.float32  # this machine: CPU
    monkeypatch.setattr(loading.jax, "default_backend", lambda: "gpu")
    assert jax.default_backend() == "gpu" and loading.resolve_dtype(None) == jnp.bfloat16
    assert loading.resolve_dtype("float32") == jnp.float32


def test_weights_the_config_would_leave_out_are_refused(tmp_path):
    """Biases in the weights of a config without attention_bias: refused, not silently dropped."""
    from safetensors.numpy import load_file, save_file

    from jspec.models.loading import load_folder

    write_family(tmp_path, "qwen3")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        load_folder(tmp_path)


def test_missing_tokenizer_is_named(tmp_path):
    from jspec.models.loading import load_folder

    write_family(tmp_path, "llama3")
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_folder(tmp_path)
