import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax
from hypothesis import settings

# Implicit rank promotion hides shape bugs; tests run with it off.
jax.config.update("jax_numpy_rank_promotion", "raise")

# Derandomized: the examples are the same on every run, so a failure reproduces.
settings.register_profile("jspec", derandomize=True, deadline=None, max_examples=60)
settings.load_profile("jspec")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct, fetched (SHA-256 verified) and converted once per machine."""
    from jspec.models.hub import load_model

    return load_model("smollm2-135m")


def transformers_reference(name: str):
    """(torch, tokenizer, model): transformers' own PyTorch model on the same GGUF file, float32.

    Skips the calling test when torch or transformers is not installed.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jspec.models.hub import ensure_gguf

    path = ensure_gguf(name)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return torch, tok, model.eval()
