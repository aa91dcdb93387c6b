"""The experiments' shared harness (jspec.analysis.harness) and the rules every script keeps."""

import json
import pathlib
import re

import pytest
from experiment import ROOT

from jspec import methods
from jspec.analysis import harness

EXPERIMENTS = ROOT / "experiments"
SCRIPTS = sorted(p for p in EXPERIMENTS.rglob("*.py") if "out" not in p.relative_to(EXPERIMENTS).parts)


def test_interleaved_seconds_compiles_each_once_then_takes_turns_in_changing_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    seconds = harness.interleaved_seconds(fns, repeats=3)
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: len(v) for k, v in seconds.items()} == {"a": 3, "b": 3, "c": 3}
    calls.clear()
    harness.interleaved_seconds(fns, repeats=2, rotate=False)  # the negative control: a fixed order
    assert calls == ["a", "b", "c"] * 3
    with pytest.raises(ValueError, match="repeats >= 1"):
        harness.interleaved_seconds(fns, repeats=0)


def _balance(orders, n):
    """How often each decoder takes each place, and how often each runs right after each other."""
    import itertools
    from collections import Counter

    places = Counter((j, d) for order in orders for j, d in enumerate(order))
    follows = Counter(pair for order in orders for pair in itertools.pairwise(order))
    return set(places.values()), {follows[(a, b)] for a in range(n) for b in range(n) if a != b}


@pytest.mark.parametrize("n", range(1, 9))
def test_turn_order_puts_every_decoder_in_every_place_and_after_every_other_equally_often(n):
    from jspec.analysis.bench import turn_order

    cycle = n if n % 2 == 0 else 2 * n
    orders = [turn_order(n, i) for i in range(cycle)]
    assert all(sorted(order) == list(range(n)) for order in orders) and turn_order(n, cycle) == orders[0]
    places, follows = _balance(orders, n)
    assert places == {cycle // n} and len(follows) <= 1  # each pair cycle // n times (n = 1: no pairs)
    if n >= 3:  # negative control: the rotation used before, in which b always ran right after a
        rotated = [[(j + i) % n for j in range(n)] for i in range(cycle)]
        assert _balance(rotated, n)[0] == {cycle // n} and len(_balance(rotated, n)[1]) > 1


def test_save_records_the_run_with_its_specs_and_the_specs_round_trip(tmp_path):
    import argparse

    spec = methods.parse("ngram", num_draft=3)
    args = argparse.Namespace(out=tmp_path, limit=4)
    report = harness.save(tmp_path / "r" / "x.json", {"speedup": 1.2}, args=args, specs=["ar", spec], started=0.0)
    saved = json.loads((tmp_path / "r" / "x.json").read_text())
    assert saved == report and saved["speedup"] == 1.2
    run = saved["run"]
    assert run["schema"] == harness.SCHEMA and run["args"] == {"out": str(tmp_path), "limit": 4}
    assert run["specs"][0] == "ar" and methods.from_json(run["specs"][1]) == spec
    assert {"platform", "cpus", "backend", "device_kind"} <= set(run["machine"])
    assert run["versions"]["jax"] and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", run["date"])
    assert run["seconds"] > 0 and not list(tmp_path.rglob("*.tmp"))
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", run["versions"]["jspec"])  # the tests run in a checkout


def test_a_result_that_cannot_be_written_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "x.json"
    harness.save(path, {"n": 1})
    circular = {}
    circular["self"] = circular
    with pytest.raises(ValueError, match="Circular"):
        harness.save(path, circular)
    assert json.loads(path.read_text())["n"] == 1


def test_append_collects_runs_and_refuses_a_file_of_another_kind(tmp_path):
    path = tmp_path / "runs.json"
    harness.append(path, {"n": 1})
    previous = harness.runs(path)
    harness.append(path, {"n": 2}, previous=previous)
    harness.append(path, {"n": 3}, previous=previous)  # a run saving as it goes replaces its own entry
    assert [r["n"] for r in harness.runs(path)] == [1, 3] and all("run" in r for r in harness.runs(path))
    harness.save(tmp_path / "one.json", {"n": 1})
    with pytest.raises(ValueError, match="not a list of runs"):
        harness.append(tmp_path / "one.json", {"n": 2})


def test_plot_saves_the_figure_and_load_script_refuses_a_missing_file(tmp_path):
    with harness.plot(tmp_path / "p.png", figsize=(3, 2)) as fig:
        fig.subplots().plot([0, 1], [1, 0])
    assert (tmp_path / "p.png").stat().st_size > 1_000
    with pytest.raises(FileNotFoundError, match="no experiment script"):
        harness.load_script(tmp_path / "nothing.py")


def test_the_list_arguments():
    assert harness.ints("1,2,,4") == [1, 2, 4] and harness.floats("0,0.7") == [0.0, 0.7]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(EXPERIMENTS)))
def test_every_script_records_through_the_harness_and_imports_no_other_way(script):
    """Every script writes what it measured through the harness (so its file names the run's spec,
    machine, versions and date), reaches no sibling through sys.path and nothing in tests/."""
    text = script.read_text()
    assert "from jspec.analysis.harness import" in text
    assert re.search(r"\b(save|append)\(", text), "writes no result through harness.save/append"
    assert "sys.path" not in text and not re.search(r"^\s*(from|import) (tests|experiment|harness)\b", text, re.M)


def test_the_index_lists_every_script_once_under_its_folder():
    index = (EXPERIMENTS / "README.md").read_text()
    listed = re.findall(r"^\| \[`([\w/]+\.(?:py|sh))`\]", index, re.M)
    on_disk = sorted(str(p.relative_to(EXPERIMENTS)) for p in [*SCRIPTS, *EXPERIMENTS.glob("*.sh")])
    assert sorted(listed) == on_disk
    folders = {p.parent.name for p in SCRIPTS if p.parent != EXPERIMENTS}
    assert folders == {"benchmarks", "ablations", "costs", "investigations"}


def test_the_common_options_keep_each_scripts_defaults_and_refuse_an_unknown_one(tmp_path):
    parser = harness.arguments("doc", model="smollm2-135m", limit=3, out="experiments/out")
    args = parser.parse_args(["--limit", "5"])
    assert (args.model, args.limit, args.out) == ("smollm2-135m", 5, pathlib.Path("experiments/out"))
    assert parser.parse_args(["--out", str(tmp_path)]).out == tmp_path
    with pytest.raises(TypeError, match="no common option budget"):
        harness.arguments("doc", budget=3)
