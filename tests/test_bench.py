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


class _Counting:
    """A decoder that answers at once (no model): the prompt back, with a chosen number of seconds."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = [], fail_at

    def generate(self, rows, max_new_tokens, sampling=None, seed=0, pad_to=None):
        from jspec.loop.results import GenerationResult

        if seed == self.fail_at:
            raise KeyboardInterrupt  # the run killed at this batch
        self.calls.append(seed)
        return GenerationResult(tokens=[list(r)[:max_new_tokens] for r in rows], seconds=1.0 + seed,
                                compile_seconds=0.0, target_calls=max_new_tokens)  # fmt: skip


def test_a_killed_run_resumes_from_its_journal_and_refuses_another_runs(tmp_path):
    from jspec.analysis.bench import run_interleaved

    prompts, journal = [[3, 4], [5, 6], [7, 8]], tmp_path / "j.jsonl"
    whole = run_interleaved({"a": _Counting(), "b": _Counting()}, prompts, 2, None)
    with pytest.raises(KeyboardInterrupt):  # killed during the third prompt (seed 2)
        run_interleaved({"a": _Counting(), "b": _Counting(fail_at=2)}, prompts, 2, None, journal=journal)
    with journal.open("a") as f:
        f.write('{"batch": 2, "resu')  # and a line torn as the process died
    again = {"a": _Counting(), "b": _Counting()}
    resumed = run_interleaved(again, prompts, 2, None, journal=journal)
    assert [d.calls for d in again.values()] == [[0, 2], [0, 2]]  # warm-up (seed 0), then only the third prompt
    assert {n: e.pop("resumed_batches") for n, e in resumed.items()} == {"a": 2, "b": 2}
    whole = {n: {k: v for k, v in e.items() if k != "resumed_batches"} for n, e in whole.items()}
    assert resumed == whole  # the batches kept, read back, sum as a run that was never killed
    assert len(journal.read_text().splitlines()) == 1 + 3  # the key, then a line per batch; the torn one cut
    # Negative controls: another run's journal, or a damaged line before the last, is refused untouched.
    for other in ({"a": _Counting()}, {"a": _Counting(), "b": _Counting()}):
        with pytest.raises(ValueError, match="journal of another run"):
            run_interleaved(other, prompts[:2] if len(other) == 2 else prompts, 2, None, journal=journal)
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join([lines[0], lines[1][:-5], *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        run_interleaved({"a": _Counting(), "b": _Counting()}, prompts, 2, None, journal=journal)
    results = tmp_path / "results.json"
    results.write_text('{"not": "a journal"}')  # no newline: neither torn nor a journal
    with pytest.raises(ValueError, match="not a journal"):
        run_interleaved({"a": _Counting()}, prompts, 2, None, journal=results)
    assert results.read_text() == '{"not": "a journal"}'
