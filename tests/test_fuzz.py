"""Property-based tests (hypothesis) over the public API and the CLI: every input either gets a clear,
one-line ValueError (exit status 2 on the command line) before anything compiles, or, where it is legal,
the right answer. Derandomized, so a CI run is reproducible; each property compiles at most a few buckets."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jspec
from jspec.cli.main import main
from jspec.core.sampling import SamplingParams, probs_from_logits
from jspec.models.tiny import tiny_model

V, CONTEXT = 97, 64
_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]  # fixtures here hold no per-example state
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=_QUIET)
FEW = settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=_QUIET)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", max_position=CONTEXT)


@pytest.fixture(scope="module")
def plain(target):
    return jspec.Decoder(target, eos_ids=())


def _assert_one_clear_line(err: Exception) -> None:
    message = str(err)
    assert message and "\n" not in message and "Traceback" not in message, message


legal_prompts = st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=20), min_size=1, max_size=4)

# One defect at a time, put into an otherwise legal request, and the words its refusal must use.
DEFECTS = {
    "id above the vocabulary": (lambda ps, m, r: ([*ps[:-1], [*ps[-1], V + r % 5]], m), "outside the vocabulary"),
    "negative id": (lambda ps, m, r: ([[-1 - r % 3, *ps[0]], *ps[1:]], m), "outside the vocabulary"),
    "empty prompt": (lambda ps, m, r: ([*ps, []], m), "is empty"),
    "no prompts": (lambda ps, m, r: ([], m), "no prompts"),
    "flat list": (lambda ps, m, r: (ps[0], m), "flat list"),
    "text": (lambda ps, m, r: (["some text"], m), "string"),
    "zero budget": (lambda ps, m, r: (ps, 0), "max_new_tokens"),
    "negative budget": (lambda ps, m, r: (ps, -1 - r % 7), "max_new_tokens"),
    "fractional budget": (lambda ps, m, r: (ps, m + 0.5), "max_new_tokens"),
    "huge budget": (lambda ps, m, r: (ps, 10**9), "context"),
    "over-long prompt": (lambda ps, m, r: ([*ps, [1] * (CONTEXT - m + 1 + r % 9)], m), "context"),
}


@pytest.fixture
def nothing_compiles(monkeypatch):
    """Fails the test if anything is compiled: refusals must come before jit."""
    import jspec.loop.host

    monkeypatch.setattr(jspec.loop.host, "compile_request", lambda *a, **k: pytest.fail("compiled a refused request"))


@FUZZ
@given(prompts=legal_prompts, max_new=st.integers(1, 20), defect=st.sampled_from(sorted(DEFECTS)),
       r=st.integers(0, 100))  # fmt: skip
def test_each_defect_is_refused_before_compiling_with_one_clear_line(plain, nothing_compiles, prompts, max_new,
                                                                     defect, r):  # fmt: skip
    mutate, words = DEFECTS[defect]
    bad_prompts, bad_budget = mutate(prompts, max_new, r)
    with pytest.raises(ValueError, match=words) as err:
        plain.generate(bad_prompts, bad_budget)
    _assert_one_clear_line(err.value)


@FEW
@given(
    prompts=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=16), min_size=2, max_size=3),
    max_new=st.just(10),  # one budget: the cache's size follows it, so each would compile anew
)
def test_legal_mixed_batches_decode_each_row_as_alone_and_speculation_keeps_greedy_output(
    target, plain, prompts, max_new
):
    """Batches of mixed lengths: every row equals its own single-row decode, and prompt lookup's greedy
    output equals plain decoding's."""
    together = plain.generate(prompts, max_new).tokens
    alone = [plain.generate([p], max_new).tokens[0] for p in prompts]
    assert together == alone
    assert all(len(t) == max_new for t in together)  # no end-of-sequence ids: every row runs its budget
    spec = jspec.SpeculativeDecoder(target, jspec.make_drafter("ngram", target, num_draft=3), eos_ids=())
    assert spec.generate(prompts, max_new).tokens == together


_probs = jax.jit(probs_from_logits)  # the knobs are arrays: one compilation for every example

knob = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3 * V), st.just(1e-6))


@FUZZ
@given(temperature=knob, top_k=knob, top_p=knob)
def test_sampling_knobs_are_refused_or_give_a_distribution_that_obeys_them(temperature, top_k, top_p):
    legal = (
        math.isfinite(temperature)
        and 0 <= temperature <= np.finfo(np.float32).max
        and float(top_k) == int(top_k)
        and top_k >= 0
        and math.isfinite(top_p)
        and 0 < top_p <= 1
    )
    if not legal:
        with pytest.raises(ValueError) as err:
            SamplingParams.create(temperature, top_k, top_p)
        _assert_one_clear_line(err.value)
        return
    logits = jax.random.normal(jax.random.PRNGKey(0), (V,)) * 3
    probs = np.asarray(_probs(logits, SamplingParams.create(temperature, top_k, top_p)), np.float64)
    assert np.all(probs >= 0) and abs(probs.sum() - 1) < 1e-5
    order = np.argsort(-np.asarray(logits))
    if temperature == 0 or temperature <= 1e-6:  # greedy, or so cold that it is: the argmax
        assert probs[order[0]] > 0.999
        return
    if 0 < top_k < V:
        assert np.count_nonzero(probs) <= top_k
    if top_k == 0 or top_k >= V:  # top-k above the vocabulary keeps every token
        kept = np.count_nonzero(probs)
        assert kept == V or top_p < 1 or temperature < 0.05, kept


def test_nan_or_infinite_logits_from_a_model_are_refused_never_returned_as_tokens(target):
    """A model whose weights went NaN (or whose logits overflow to +inf): plain and speculative decoding,
    greedy and sampled, raise instead of returning garbage ids."""
    broken = tiny_model("llama", max_position=CONTEXT)
    broken.final_norm[...] = broken.final_norm[...].at[0].set(jnp.nan)
    inf = tiny_model("llama", max_position=CONTEXT)
    inf.final_norm[...] = inf.final_norm[...] * jnp.inf
    for model in (broken, inf):
        decoders = [
            jspec.Decoder(model, eos_ids=()),
            jspec.SpeculativeDecoder(model, jspec.make_drafter("ngram", model, num_draft=3), eos_ids=()),
        ]
        for decoder in decoders:
            for sampling in (SamplingParams.greedy(), SamplingParams.create(1.0)):
                with pytest.raises(ValueError, match="NaN or infinite logits") as err:
                    decoder.generate([[5, 6, 7, 5, 6]], 6, sampling)
                _assert_one_clear_line(err.value)


def test_a_draft_wider_than_the_context_is_refused(target):
    with pytest.raises(ValueError, match="more than the target's context") as err:
        jspec.SpeculativeDecoder(target, jspec.make_drafter("ngram", target, num_draft=CONTEXT), eos_ids=())
    _assert_one_clear_line(err.value)


flag_values = {
    "--max-new-tokens": st.sampled_from(["0", "-1", "1.5", "x"]),
    "--temperature": st.sampled_from(["-1", "nan", "inf", "x"]),
    "--top-p": st.sampled_from(["0", "1.5", "-0.1", "nan"]),
    "--top-k": st.sampled_from(["-1", "2.5"]),
    "--num-draft": st.sampled_from(["0", "-3"]),
}


@FUZZ
@given(flag=st.sampled_from(sorted(flag_values)), data=st.data())
def test_the_command_line_refuses_bad_values_with_exit_status_2_and_one_line(flag, data, capsys):
    value = data.draw(flag_values[flag])
    argv = ["generate", "--prompt", "hi", "--method", "ngram", flag, value]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own refusal of a value that is no number at all
        code = stop.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
