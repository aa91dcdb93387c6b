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
