"""Aggregating runs over prompts, and the wall time the measured costs predict."""

import pytest

from jspec.analysis.bench import predicted_seconds, run_prompts
from jspec.drafters import PromptLookup
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.models.tiny import tiny_model


def test_predicted_seconds_adds_up_the_steps():
    entry = {"verify_steps": 10, "plain_steps": 5, "acceptance_by_position": [0.5, 0.5]}  # N = 2
    seconds = predicted_seconds(entry, 0.1, 1.0, {3: 1.5}, draft_units=0.2, plain_units=0.1, prefill_units=0.5)
    assert seconds == pytest.approx(1.0 * 1.5 + 0.1 * (10 * (1.5 + 0.2) + 5 * (1 + 0.1)))


def test_run_prompts_sums_runs_and_reports_speculation():
    model = tiny_model("llama")
    prompts = [[3, 4, 5, 3, 4], [7, 8, 9]]
    plain = run_prompts(Decoder(model), prompts, 6, None)
    assert plain["new_tokens"] == 12 and plain["tau"] == 1.0 and plain["target_calls"] == 2 * 6
    spec = run_prompts(SpeculativeDecoder(model, PromptLookup(num_draft=3)), prompts, 6, None)
    assert spec["new_tokens"] == 12 and len(spec["acceptance_by_position"]) == 3
    assert spec["target_calls"] == 2 + spec["verify_steps"] + spec["plain_steps"]
    assert 1.0 <= spec["tau"] <= 4.0


def test_one_shape_runs_every_prompt_in_one_program_with_the_lone_request_tokens():
    """Prompts in three length buckets: one compiled loop per decoder (one_shape), three without."""
    from jspec.analysis.bench import run_interleaved

    model = tiny_model("llama")
    prompts = [[3, 4, 5, 3, 4], list(range(3, 23)), [7, 8, 9, 7, 8, 9] * 7]  # buckets 16, 32, 64
    one = {"plain": Decoder(model), "ngram": SpeculativeDecoder(model, PromptLookup(num_draft=3))}
    run_interleaved(one, prompts, 6, None)
    assert [len(d._compiled) for d in one.values()] == [1, 1]
    for decoder in one.values():
        for p in prompts:  # sized for the longest prompt, the same tokens as a lone request
            assert decoder.generate([p], 6, pad_to=len(prompts[-1])).tokens == decoder.generate([p], 6).tokens
    each = {"plain": Decoder(model)}
    run_interleaved(each, prompts, 6, None, one_shape=False)  # negative control: a loop per bucket
    assert len(each["plain"]._compiled) == 3
    with pytest.raises(ValueError, match="pad_to must be a positive token count"):
        one["plain"].generate([prompts[0]], 6, pad_to=0)
