import atexit
import os
import shutil
import tempfile


def xla_flags(devices: int = 1) -> str:
    """XLA_FLAGS for a test process: `devices` simulated CPU devices, LLVM's optimizations off, and
    fusions emitted by XLA's older (elemental) CPU emitter.

    Tests spend most of their time compiling small programs and little running them: at LLVM's
    level 0 a tiny model's engine test compiled and ran in 11.5 s against 18.0 s, a SmolLM2 prompt
    lookup test in 22.3 s against 26.6 s (docs/log, make test at XLA's level 0). Without the MLIR
    fusion emitters a tiny model's plain, prompt lookup and draft model loops compiled in 3.8-4.1 s
    against 5.8-6.3 s; SmolLM2's compile slower (12.7-17.3 s against 10.9 s), and the suite took 0.70
    of its time (docs/log, make test without the fusion emitters;
    experiments/investigations/xla_compile_flags.py). Not quite the same programs as a user's: without
    the fusion emitters XLA's CPU compiler also rewrites some HLO itself (scatters become loops:
    xla/service/cpu/cpu_compiler.cc reads the flag in its pass pipeline), and the machine code differs.
    What the tests check (greedy tokens equal to plain decoding's, distributions, parity within
    PARITY_RTOL) holds for either; users run XLA's defaults.
    """
    return (
        f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
        " --xla_cpu_use_fusion_emitters=false"
    )


os.environ.setdefault("XLA_FLAGS", xla_flags())
# One persistent compilation cache per test run, empty at its start: made by the first process
# (pytest itself, or xdist's controller, which loads this file before it starts the workers) and
# shared by the workers and the processes tests start. What a test compiles never depends on an
# earlier run or on ~/.cache/jspec/xla, and a real model's loop compiled in one test file is read
# back in the next (the fixture below drops every in-memory program after each file).
# tests/test_compile_cache.py checks the cache and its switch themselves.
if "JSPEC_TEST_XLA_CACHE" not in os.environ:
    os.environ["JSPEC_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jspec-test-xla-")
    atexit.register(shutil.rmtree, os.environ["JSPEC_TEST_XLA_CACHE"], True)
os.environ["JSPEC_XLA_CACHE"] = os.environ["JSPEC_TEST_XLA_CACHE"]

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

# Implicit rank promotion hides shape bugs; tests run with it off.
jax.config.update("jax_numpy_rank_promotion", "raise")

# Derandomized: the examples are the same on every run, so a failure reproduces.
settings.register_profile("jspec", derandomize=True, deadline=None, max_examples=60)
settings.load_profile("jspec")

import gc  # noqa: E402

import pytest  # noqa: E402

# The files that took longest on one worker (make test's --durations and fixtures, 2026-12-03 and -04) start first:
# pytest-xdist's --dist loadfile hands out files in collection order, and a long file started last keeps
# one worker busy after the other has run out of files.
LONGEST_FIRST = ("test_published_heads.py", "test_train_mesh.py", "test_reliability.py", "test_sharding.py",
                 "test_real_smollm2.py", "test_real_shipped_head.py", "test_adaptive.py", "test_lookahead.py",
                 "test_eagle.py", "test_fuzz.py", "test_compile_cache.py", "test_medusa.py")  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees every compiled program after each test module.

    XLA's CPU backend maps each executable's machine code into its own memory regions. The
    suite compiles thousands of programs in one process; kept, their regions passed the
    kernel's limit of 65,530 mappings per process (vm.max_map_count) about 80% of the way
    through, and the next compilation died with a segmentation fault inside XLA.
    """
    yield
    jax.clear_caches()
    gc.collect()


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


PARITY_RTOL = 1e-4  # max |jspec - torch| / max |torch| over all logits; set once for every model


def assert_logits_match(model, tok, reference, texts) -> None:
    """Same tokens as transformers' tokenizer, logits within PARITY_RTOL, same argmax everywhere."""
    import jax.numpy as jnp
    import numpy as np

    torch, ref_tok, ref_model = reference
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref_tok(text)["input_ids"]
        with torch.no_grad():
            want = ref_model(torch.tensor([ids])).logits[0].numpy()
        cache = model.init_cache(1, len(ids))
        got = np.asarray(model(jnp.array([ids]), jnp.arange(len(ids))[None], cache).logits[0])
        assert np.abs(got - want).max() / np.abs(want).max() < PARITY_RTOL
        assert (got.argmax(-1) == want.argmax(-1)).all()


def assert_greedy_matches(model, tok, reference, ids, max_new: int) -> None:
    """jspec's greedy tokens equal transformers' generate(do_sample=False), up to the shorter of the two."""
    from jspec.loop.decode import Decoder

    torch, _, ref_model = reference
    with torch.no_grad():
        out = ref_model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    want = out[0, len(ids) :].tolist()
    got = Decoder(model, eos_ids=tok.eos_token_ids).generate([ids], max_new).tokens[0]
    n = min(len(got), len(want))
    assert got[:n] == want[:n] and n >= 8
