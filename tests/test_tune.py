"""The cost profile: measured on tiny models, cached per model, backend, dtype and batch bucket, refused if damaged."""

import json

import pytest

from jspec.drafters import DraftModel, PromptLookup
from jspec.models.tiny import tiny_model
from jspec.tune.costs import CostProfile, load_profile, measure_profile, profile_path, save_profile


@pytest.fixture(scope="module")
def profile():
    target = tiny_model("qwen2", seed=0)
    drafters = {
        "ngram:N=2": PromptLookup(num_draft=2),
        "draft:N=3": DraftModel.from_model(tiny_model("qwen2", seed=1, num_layers=1), target, num_draft=3),
    }
    return measure_profile(target, "tiny", drafters, batch=3, max_k=4, context=32, repeats=2)


def test_a_profile_holds_every_forward_and_drafter_measured(profile):
    assert sorted(profile.forward_ms) == [1, 2, 3, 4] and all(v > 0 for v in profile.forward_ms.values())
    assert profile.relative_forward(1) == 1.0 and profile.batch == 4  # batch 3 is measured at its bucket
    assert set(profile.drafters) == {"ngram:N=2", "draft:N=3"}
    assert profile.relative_drafter("draft:N=3") > 0 and profile.dtype == "float32"
    with pytest.raises(ValueError, match=r"forwards of \[1, 2, 3, 4\] tokens, not 9"):
        profile.relative_forward(9)
    with pytest.raises(ValueError, match="no drafter 'eagle3:N=1'"):
        profile.relative_drafter("eagle3:N=1")


def test_a_quick_profile_measures_the_verify_widths_alone_and_is_reused_while_it_covers(monkeypatch, tmp_path):
    from jspec.tune import costs

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    target = tiny_model("qwen2", seed=0)
    measured = []
    real = costs.measure_profile
    monkeypatch.setattr(costs, "measure_profile", lambda *a, **k: measured.append(k["widths"]) or real(*a, **k))
    quick = {f"ngram:N={n}": PromptLookup(num_draft=n) for n in (2, 4)}
    profile, _, cached = costs.ensure_profile(target, "tiny", quick, max_k=None)
    assert not cached and sorted(profile.forward_ms) == [1, 3, 5]  # a plain step, N + 1 for each N
    assert costs.ensure_profile(target, "tiny", quick, max_k=None)[2]  # covered: read back
    assert costs.ensure_profile(target, "tiny", {"ngram:N=2": quick["ngram:N=2"]}, max_k=None)[2]
    profile, _, cached = costs.ensure_profile(target, "tiny", quick, max_k=4)  # 2 and 4 were never measured
    assert not cached and sorted(profile.forward_ms) == [1, 2, 3, 4, 5] and len(measured) == 2


def test_profiles_round_trip_and_are_keyed_by_what_changes_costs(profile, tmp_path):
    path = profile_path("tiny", 3, root=tmp_path)
    assert path == profile_path("tiny", 4, root=tmp_path)  # one bucket
    others = [
        profile_path("tiny", 1, root=tmp_path),
        profile_path("tiny", 3, root=tmp_path, dtype="bfloat16"),
        profile_path("other", 3, root=tmp_path),
        profile_path("tiny", 3, root=tmp_path, backend="gpu"),
    ]
    assert len({path, *others}) == 5
    assert load_profile(path) is None
    save_profile(profile, path)
    assert load_profile(path) == profile


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"model": "tiny", "forward', "corrupt or truncated"),
        ('{"version": 99}', "not a jspec cost profile"),
        ("[1, 2]", "not a jspec cost profile"),
    ],
)
def test_a_damaged_profile_is_refused_and_kept(profile, tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_profile(path)
    assert path.read_text() == text  # nothing deleted or rewritten


def test_a_profile_with_malformed_costs_is_refused(profile, tmp_path):
    bad = profile.to_json() | {"forward_ms": {"1": -3.0}}
    with pytest.raises(ValueError, match="positive one-token step"):
        CostProfile.from_json(json.loads(json.dumps(bad)), "p.json")
    bad = profile.to_json() | {"drafters": {"ngram:N=2": {"propose_ms": "fast"}}}
    with pytest.raises(ValueError, match="malformed costs"):
        CostProfile.from_json(bad, "p.json")


@pytest.mark.slow  # 39 s; profiles are measured, cached and refused on a tiny model above
def test_tune_profile_on_the_real_model_measures_once_then_reuses(capsys, smollm2, tmp_path, monkeypatch):
    from jspec.cli.main import main
    from jspec.models.hub import cache_root

    for name in ("models", "wheels"):  # the model as converted already; the profile goes to the test's own cache
        (tmp_path / name).symlink_to(cache_root() / name)
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    argv = ["tune", "profile", "--num-draft", "2", "--trees", "", "--max-k", "3", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert not first["cached"] and set(first["profile"]["drafters"]) == {"ngram:N=2", "eagle3:N=2"}
    assert main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["cached"] and second["profile"] == first["profile"]
    with open(first["path"], "w") as f:
        f.write("{")
    assert main(argv) == 2  # the damaged cache is refused before anything is measured
    assert "corrupt or truncated" in capsys.readouterr().err
