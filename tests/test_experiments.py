"""The experiment scripts run end to end in their tiny mode."""

import json
import statistics

import pytest
from experiment import ROOT
from experiment import load_experiment as _load

from jspec.analysis.prompts import SPEC_BENCH_DEFAULT


@pytest.mark.slow  # 8 s; the speedup math is tested in test_speedup.py
def test_speedup_table_tiny(tmp_path, capsys):
    result = _load("speedup_table").main(["--tiny", "--out", str(tmp_path)])
    assert (tmp_path / "speedup.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "speedup.json").read_text())
    assert len(saved["tables"]["1"]) == 5 * 6
    for run in result["simulation"]:
        assert abs(run["measured_tokens"] - run["expected_tokens"]) < 5 * run["measured_tokens_stderr"] + 1e-9
    assert "Sweep at alpha = 0.9" in capsys.readouterr().out


@pytest.mark.slow  # 40 s; bench_spec's pieces (run_interleaved, predictions) are tested in test_bench.py
def test_bench_spec_tiny(tmp_path, smollm2):
    report = _load("bench_spec").main(["--tiny", "--out", str(tmp_path)])
    results = report["setups"]["smollm2-ngram"]["jspec"]["results"]
    spec = results["humaneval|T=0.0|N=2"]
    assert spec["new_tokens"] == results["humaneval|T=0.0|ar"]["new_tokens"] == 8
    assert spec["predicted_speedup"] > 0 and spec["tau"] >= 1.0
    assert spec["speedup_interval"] == [0.0, float("inf")]  # one prompt: no interval, and it says so
    assert (tmp_path / "bench_spec.json").exists()


@pytest.mark.slow  # 60 s; the adaptive loop itself is tested in test_adaptive.py (CI time, 2026-12-01)
def test_adaptive_fallback_tiny(tmp_path, smollm2):
    report = _load("adaptive_fallback").main(["--tiny", "--out", str(tmp_path)])
    results = report["results"]
    plain = results["humaneval|T=0.0|plain"]
    for name in ("ngram fixed", "ngram adaptive", "ngram adaptive, forced on"):
        assert results[f"humaneval|T=0.0|{name}"]["new_tokens"] == plain["new_tokens"] == 16
    assert results["humaneval|T=0.0|ngram adaptive, forced on"]["fallback_steps"] == 0
    assert (tmp_path / "adaptive_fallback.png").stat().st_size > 5_000


@pytest.mark.slow  # 18 s; the soak script's pieces (batches of mixed lengths, budgets) are tested in test_fuzz.py
def test_soak_small(tmp_path):
    """The soak, shortened (30 requests, 1-2 rows, two methods on a tiny model): every check passes, each
    shape class compiles its loop once, every sampled request replayed, every greedy one checked."""
    report = _load("soak").main(["--tiny", "--requests", "30", "--warmup", "10", "--rows", "1-2",
                                 "--methods", "ar,ngram", "--out", str(tmp_path)])  # fmt: skip
    assert report["failures"] == []
    assert report["warmup_compilations"] == 4  # two methods x two batch sizes, each compiled once
    assert report["loop_compilations"] == 0 and report["shape_classes"] <= 4 and not report["loops_dropped"]
    assert report["replays"] + report["greedy_checked"] == 30
    assert all(abs(g) <= 0.05 for g in report["growth_after_warmup"].values())


@pytest.mark.slow  # 13 s; tree verification itself is tested in test_tree.py
def test_tree_toy_small(tmp_path):
    result = _load("tree_toy").main(["--vocab", "8", "--trials", "3000", "--mix", "0.6", "--out", str(tmp_path)])
    row = result["rows"][0]
    tree = row["sampled [2,2,2]"]
    # Each call whose path reaches depth 3 ends at exactly one of the 8 leaves.
    assert len(tree["leaf_rates"]) == 8
    assert abs(sum(tree["leaf_rates"]) - tree["depth_reached"][2]) < 1e-9
    # Two sampled children per node accept at least as often as one (same depth, more tries).
    assert tree["tokens_per_call"] > row["sampled chain 3"]["tokens_per_call"]
    for cell in (v for k, v in row.items() if isinstance(v, dict) and "tokens_per_call" in v):
        assert 1.0 <= cell["tokens_per_call"] <= 15.0
    assert (tmp_path / "tree_toy.json").exists()


def test_bench_sampling_small(tmp_path):
    argv = ["--vocab", "3000", "--batches", "1,4", "--repeats", "1", "--out", str(tmp_path)]
    result = _load("bench_sampling").main(argv)
    for row in result["ms"].values():
        assert row["same_support"] and row["top_p_0.95"] > 0


def _random_training_data(folder, hidden_size):
    """A small data set in ``jspec train``'s format, random features: enough to run a training step."""
    import numpy as np

    from jspec.training.data import write_shards

    rng = np.random.default_rng(0)
    n, t, h = 6, 24, hidden_size
    mask = np.zeros((n, t), bool)
    for i in range(n):
        mask[i, 4 + i : 12 + i] = True  # one response per example
    data = {"tokens": rng.integers(0, 1000, (n, t)).astype(np.int32), "mask": mask,
            "features": rng.standard_normal((n, t, 3, h)).astype(np.float16),
            "top": rng.standard_normal((n, t, h)).astype(np.float16), "counts": np.ones(49152, np.int64)}  # fmt: skip
    write_shards(data, folder, {"feature_layers": [2, 15, 27]})


@pytest.mark.slow  # 12 s; training steps are tested in test_eagle.py
def test_bench_train_step_small(tmp_path, smollm2):
    _random_training_data(tmp_path / "d", smollm2[0].config.hidden_size)
    args = ["--data", str(tmp_path / "d"), "--batch-size", "2", "--ttt-steps", "2", "--draft-vocab", "64"]
    report = _load("bench_train_step").main([*args, "--repeats", "1", "--out", str(tmp_path)])
    assert report["window"] == 16 and report["median_step_seconds"]["window"] > 0


@pytest.mark.slow  # 6 s on SmolLM2; batched decoding is tested in test_decode.py
def test_batch_decode_cost_small(tmp_path, smollm2):
    # --generate is left out here (two more compilations, 30 s); test_decode checks that the
    # tight cache gives the same tokens.
    report = _load("batch_decode_cost").main(
        ["--batches", "2", "--capacities", "64", "--repeats", "1", "--out", str(tmp_path)]
    )
    assert report["step_ms"]["2x64"] > 0 and report["attention_layer"]["2x64"]["keys_mb"] > 0
    assert (tmp_path / "batch_decode_cost.json").exists()


@pytest.mark.slow  # 25 s; the agreement measure is tested in test_eagle.py
def test_head_agreement_small(tmp_path, smollm2):
    head = ROOT / "models" / "heads" / "smollm2-135m-eagle3"
    argv = ["--heads", str(head), "--prompts", "humaneval", "--limit", "1", "--max-new-tokens", "8", "--steps", "2"]
    report = _load("head_agreement").main([*argv, "--out", str(tmp_path)])
    row = report["heads"][str(head)]["humaneval"]
    assert row["drafts_scored"] == [7, 6]  # 8 new tokens: the first is the target's; draft k + 1 scores 7 - k
    a1, a2 = row["agreement"]
    assert abs(row["chain_tau"] - (1 + a1 + a1 * a2)) < 1e-9
    assert (tmp_path / "head_agreement.json").exists()


@pytest.mark.slow  # 27 s; warm starts are tested in test_eagle.py
def test_warm_start_small(tmp_path, smollm2):
    _random_training_data(tmp_path / "d", smollm2[0].config.hidden_size)
    argv = ["--data", str(tmp_path / "d"), "--steps", "2", "--batch-size", "2", "--ttt-steps", "2",
            "--draft-vocab", "64", "--starts", "random,target", "--prompts", "humaneval", "--limit", "1",
            "--max-new-tokens", "6"]  # fmt: skip
    report = _load("warm_start").main([*argv, "--out", str(tmp_path / "o")])
    assert set(report["starts"]) == {"random", "target"}
    for row in report["starts"].values():
        assert row["held_out"]["humaneval"]["drafts_scored"] == [5, 4]
    assert (tmp_path / "o" / "warm_start.json").exists()


@pytest.mark.slow  # 90 s; tune and auto are tested in test_auto.py and notebook 05 (CI time, 2026-12-01)
def test_auto_cells_tiny(tmp_path, smollm2, monkeypatch):
    """Tune on one HumanEval prompt, then auto beside plain and prompt lookup on another; the
    profile and tuned config go to a cache of the test's own (the model and wheels linked in)."""
    from jspec.models.hub import cache_root

    real = cache_root()
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("models", "wheels"):
        (cache / name).symlink_to(real / name)
    monkeypatch.setenv("JSPEC_CACHE", str(cache))
    report = _load("auto_cells").main(["--tiny", "--out", str(tmp_path)])
    (cell,) = report["cells"]
    assert cell["workload"] == "humaneval" and cell["temperature"] == 0.0
    assert {"ar", "ngram:N=3", "auto"} <= set(cell["speedup"]) and cell["auto_ran"] == cell["recommended"]
    assert cell["tune_prediction_errors"] and (tmp_path / "auto_cells.png").stat().st_size > 5_000
    lo, hi = cell["auto_over_plain_interval"]
    assert lo <= hi and report["goals"]["cells"] == 1
    assert all(len(b["batch_seconds"]) == cell["prompts"] for b in cell["batches"].values())  # readable again
    assert sorted(p.name for p in (cache / "tuned").glob("*/*.json")) == ["humaneval.json", "latest.json"]
    module = _load("auto_cells")  # run again with the same arguments: the finished cell is kept, nothing measured
    monkeypatch.setattr(module, "_tune", lambda *a: pytest.fail("tuned again"))
    assert module.main(["--tiny", "--out", str(tmp_path)])["cells"] == report["cells"]


@pytest.mark.slow  # ~60 s on SmolLM2; Lookahead decoding itself is tested in test_lookahead.py
def test_lookahead_grid_tiny(tmp_path, smollm2):
    report = _load("lookahead_grid").main(["--tiny", "--out", str(tmp_path)])
    results = report["results"]
    for name in ("lookahead 2:2:1", "ngram 1x1", "lookahead 2:3:2", "ngram 2x2"):
        entry = results[f"mt-bench|{name}"]
        assert entry["new_tokens"] == results["mt-bench|plain"]["new_tokens"] == 16
        assert entry["predicted"] > 0 and entry["r"] > 0
    assert results["mt-bench|lookahead 2:3:2"]["width"] == 1 + 2 * 2 + 2 * 2


def test_spec_bench_categories():
    module = _load("spec_bench_table")
    with pytest.raises(ValueError, match="Spec-Bench has no category 'poetry'"):
        module.category_prompts("poetry", 1)
    if not SPEC_BENCH_DEFAULT.exists():  # a clone with no ../shared beside it (a user's, or one in /tmp)
        pytest.skip("Spec-Bench is not beside the project")
    assert {p.category for p in module.category_prompts("multi-turn", 80)} == set(module.MULTI_TURN)
    assert len(module.category_prompts("multi-turn", 80)) == 80 and len(module.category_prompts("rag", 2)) == 2


@pytest.mark.slow  # ~60 s on SmolLM2; run_interleaved and the drafters are tested elsewhere
def test_spec_bench_table_tiny(tmp_path, smollm2):
    module = _load("spec_bench_table")
    report = module.main(["--tiny", "--out", str(tmp_path)])
    assert set(report["table"]) == {"T=0|qa|ar", "T=0|qa|ngram", "T=0|qa|lookahead"}
    assert "predicted" in report["table"]["T=0|qa|lookahead"]
    assert report["table"]["T=0|qa|ngram"]["interval"] == [0.0, float("inf")]  # one prompt: no interval, said
    assert (tmp_path / "spec_bench_table.png").stat().st_size > 5_000
    assert "| lookahead |" in (tmp_path / "spec_bench_table.md").read_text()


@pytest.mark.slow  # ~35 s of compiling on CPU-2; the accelerator run is what it is for
def test_device_check_small(tmp_path):
    """The accelerator check runs end to end on CPU at tiny shapes and reports every figure it promises."""
    report = _load("device_check").main(["--small", "--out", str(tmp_path)])
    tiny = report["shapes"]["tiny"]
    assert report["backend"] == "cpu" and tiny["skipped"] == [] and tiny["dtype"] == "float32"
    assert {"plain", "speculative"} <= set(tiny["compile_s"]) and tiny["plain_tokens_per_s"] > 0
    assert tiny["r"][1] == 1.0 and set(tiny["r"]) == {1, 2, 4} and set(tiny["batch_tokens_per_s"]) == {1, 2}
    assert tiny["loop_overhead"] > 0 and tiny["speculative_verify_steps"] <= 2
    assert json.loads((tmp_path / "device_check.json").read_text())["shapes"]["tiny"]["weight_bytes"] > 0
    for case in ("chain5", "tree"):  # a published-shape EAGLE-3 head's cost and the paper's tau's speedup
        e = tiny["eagle3"][case]
        assert e["c"] > 0 and e["r"] >= 0.5 and e["speedup_at_paper_tau"] == pytest.approx(6.13 / (e["r"] + e["c"]))


@pytest.mark.slow  # SmolLM2 at batches 1 and 2, about 2 minutes here
def test_batch_throughput_tiny(tmp_path):
    report = _load("batch_throughput").main(["--tiny", "--out", str(tmp_path)])
    cells = {(c["batch"], c["method"]): c for c in report["cells"]}
    assert set(cells) == {(1, "ar"), (1, "ngram"), (2, "ar"), (2, "ngram")}
    assert all(c["tokens_per_s"] > 0 and c["prefill_ms"] > 0 for c in cells.values())
    ngram = cells[(2, "ngram")]  # greedy: the same tokens as plain decoding, so the prefill pulls toward 1
    assert ngram["new_tokens"] == cells[(2, "ar")]["new_tokens"] and ngram["predicted_loop"] > 0
    assert min(1, ngram["predicted_loop"]) <= ngram["predicted"] <= max(1, ngram["predicted_loop"])
    assert "ngram|T=0" in report["crossover"] and (tmp_path / "batch_throughput.png").stat().st_size > 5_000


@pytest.mark.slow  # ~2 minutes on SmolLM2 here; the accelerator run is what it is for
def test_device_train_head_tiny(tmp_path, monkeypatch):
    """The model in parts, data, a budget-sized run, scoring beside the shipped head, the head in parts, rejoined."""
    script = _load("device_train_head")
    parts = script.main(["split", "--out", str(tmp_path / "parts"), "--part-mib", "40"])
    assert len(parts["parts"]) == 3 and all(p["bytes"] <= 40 << 20 for p in parts["parts"])
    argv = ["train", "--tiny", "--parts", str(tmp_path / "parts"), "--out", str(tmp_path / "out"), "--num-prompts",
            "8", "--eval-limit", "1", "--eval-tokens", "16", "--budget-s", "60", "--reserve-s", "0",
            "--probe-steps", "4", "--min-steps", "4", "--max-steps", "8"]  # fmt: skip
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))  # the script points it at its own work folder
    report = script.main(argv)
    assert report["examples"] == 8 and 4 <= report["total_steps"] <= 8
    steps = report["probe_step_seconds"]  # the probe's own steps, timed one by one, size the run
    assert len(steps) == 2 + 4 and report["step_s"] == statistics.median(steps[2:]) > 0
    assert {"tau_new", "tau_shipped", "better_than_shipped"} <= set(report)
    head_parts = tmp_path / "out" / "head_parts"
    assert all(p.stat().st_size <= 16 << 20 for p in head_parts.glob("head.safetensors.part*"))
    assert script.main(["join", "--parts", str(head_parts), "--out", str(tmp_path / "joined")])
    part = next(head_parts.glob("head.safetensors.part00"))
    data = part.read_bytes()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped
    with pytest.raises(SystemExit, match="not the part the manifest records"):
        script.main(["join", "--parts", str(head_parts), "--out", str(tmp_path / "joined2")])
    (tmp_path / "parts" / "smollm2-135m.gguf.part01").unlink()
    with pytest.raises(SystemExit, match=r"lacks \['smollm2-135m.gguf.part01'\]"):
        script.main([*argv[:5], str(tmp_path / "out2"), *argv[6:]])


def test_load_memory_tiny(tmp_path):
    """The sharded random folder loads through jspec's own loader (as the Hub writes one) and the report
    holds what the log (docs/log/) records."""
    script = _load("load_memory")
    out = tmp_path / "runs.json"
    argv = [
        "--shape",
        "tiny",
        "--folder",
        str(tmp_path / "tiny"),
        "--shard-mb",
        "0",
        "--out",
        str(out),
    ]
    script.main(argv)
    (run,) = json.loads(out.read_text())
    assert run["run"]["args"]["shape"] == "tiny" and run["weights_bytes"] > 0
    assert run["peak_rss_bytes"] > run["baseline_rss_bytes"]
    assert len(list((tmp_path / "tiny").glob("model-*.safetensors"))) > 2  # one tensor a shard: sharded


@pytest.mark.slow  # ~30 s: two fresh processes compile and load SmolLM2
def test_startup_plain_cold_then_warm(tmp_path, smollm2):
    """The warm process finds both programs in the cache its cold run wrote: it compiles faster."""
    report = _load("startup").main(["--methods", "ar", "--api", "", "--work", str(tmp_path),
                                    "--out", str(tmp_path / "startup.json")])  # fmt: skip
    cold, warm = report["cli"]["ar"]["cold"], report["cli"]["ar"]["warm"]
    assert "error" not in cold and "error" not in warm
    assert warm["compile_s"] < cold["compile_s"] and cold["first_token_s"] > cold["compile_s"]
    assert json.loads((tmp_path / "startup.json").read_text())[-1]["tokens"] == 16


def test_ablate_heads_grid_collapses_options_a_kind_lacks_and_refuses_unknown_ones():
    ablate = _load("ablate_heads")
    grid = ablate.parse_grid(["kind=eagle3,eagle1,medusa", "ttt=1,3", "warm=0,1"])
    names = [ablate.cell_name(c) for c in ablate.cells(grid)]
    assert len(names) == 4 + 2 + 1  # EAGLE-3: 2 TTT x 2 warm; EAGLE-1: 1 TTT x 2 warm; Medusa: one
    assert "kind=medusa layers=top decay=0.8 warm=0" in names
    for bad, message in ((["depth=3"], "KEY one of"), (["kind=eagle2"], "not head kinds"), (["ttt=0"], "at least 1"),
                         (["layers=2-x"], "neither 'default'"), (["ttt=1", "ttt=3"], "names ttt twice")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ablate.parse_grid(bad)


@pytest.mark.slow  # ~5 minutes on SmolLM2; training each kind is tested in test_eagle.py and test_medusa.py
def test_ablate_heads_tiny_runs_each_kind_on_the_same_data_resumes_and_refuses_other_arguments(tmp_path, smollm2):
    ablate = _load("ablate_heads")
    argv = ["--tiny", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--grid",
            "kind=eagle3,eagle1,medusa", "--batch-size", "2", "--heldout", "2", "--limit", "1",
            "--eval-tokens", "16", "--num-draft", "2", "--steps", "6"]  # fmt: skip
    report = ablate.main(argv)
    assert [c["cell"]["kind"] for c in report["cells"].values()] == ["eagle3", "eagle1", "medusa"]
    for cell in report["cells"].values():
        assert len(cell["agreement"]) == 2 and cell["tau"] >= 1.0 and cell["predicted_speedup"] > 0
        assert cell["tau_heldout"] >= 1.0 and cell["r"] > 1.0 and cell["drafter_cost"] > 0
    assert (tmp_path / "out" / "ablate_heads.png").stat().st_size > 5_000
    assert ablate.main(argv)["cells"] == report["cells"]  # kept, not re-run
    with pytest.raises(SystemExit, match=r"other arguments \(steps\)"):
        ablate.main([*argv[:-1], "7"])
    # The saved ids remake the same data (the target's features again, nothing generated).
    import numpy as np

    from jspec.training.data import load_shards

    again = [*argv[:1], "--ids", str(tmp_path / "out" / "ids.npz"), "--data", str(tmp_path / "data2"), "--out",
             str(tmp_path / "out2"), "--grid", "kind=medusa", *argv[7:-1], "2"]  # fmt: skip
    ablate.main(again)
    (first, _), (second, meta) = load_shards(tmp_path / "data"), load_shards(tmp_path / "data2")
    assert meta["from_ids"] == str(tmp_path / "out" / "ids.npz")
    for key in ("tokens", "mask", "features", "top"):
        np.testing.assert_array_equal(second[key], first[key])


def test_same_program_ignores_names_and_debug_information_but_not_instructions():
    canonical = _load("same_program").canonical
    a = '%add.1 = s32[] add(%p.0, %p.1), metadata={op_name="x" source_line=3}\nROOT %select.7 = s32[] select(%add.1)'
    b = '%add.9 = s32[] add(%q.4, %q.5), metadata={op_name="y" source_line=8}\nROOT %select.2 = s32[] select(%add.9)'
    assert canonical(a) == canonical(b)
    assert canonical(a) != canonical(a.replace("add(", "subtract("))  # negative control: another instruction


def test_length_fit_recovers_costs_per_token_that_a_rate_ratio_mistakes_for_lengths(tmp_path):
    """Journal lines made from known prefills and costs per token, the answers' lengths differing by
    decoder as sampled answers do: the fit returns the costs; the rate ratio (what a cell computes)
    is far from the true 1.25x per token on the same runs (the negative control)."""
    prefill, cost = [8.0, 9.0, 7.5, 8.5], {"ar": 0.2, "ngram:N=3": 0.16}
    lengths = [(5, 48), (48, 9), (30, 31), (12, 40)]  # (plain, prompt lookup) tokens per prompt
    rows = [{"batch": i, "results": {n: {"tokens": [[0] * k], "seconds": prefill[i] + cost[n] * k}
                                     for n, k in zip(cost, ks, strict=True)}}
            for i, ks in enumerate(lengths)]  # fmt: skip
    journal = tmp_path / "journal.jsonl"
    journal.write_text("\n".join(json.dumps(r) for r in [{"key": {}}, *rows]) + "\n")
    fit = _load("length_fit").main([str(journal), "--decoders", "ar,ngram:N=3", "--out", str(tmp_path / "fit.json")])
    assert fit["speedup_per_token"]["ngram:N=3"] == pytest.approx(1.25, rel=1e-9)
    assert fit["prefill_seconds"] == pytest.approx(prefill) and fit["residual_sd_seconds"] < 1e-9

    def rate(run):
        return len(run["tokens"][0]) / run["seconds"]

    rates = [rate(r["results"]["ngram:N=3"]) / rate(r["results"]["ar"]) for r in rows]
    assert abs(statistics.geometric_mean(rates) / 1.25 - 1) > 0.1  # the cell's estimate: off by ~20%
    with pytest.raises(SystemExit, match="no runs of draft:N=4"):
        _load("length_fit").main([str(journal), "--decoders", "ar,draft:N=4", "--out", str(tmp_path / "x.json")])


@pytest.mark.slow  # 10 s: two processes compile; the flags the tests use are checked by the suite running
def test_xla_compile_flags_reports_each_loop_per_flag_set(tmp_path):
    """One fresh process per flag set (the tiny model's plain, prompt lookup and draft model loops, each
    checked against plain tokens): compile seconds per loop recorded; a flag XLA does not know fails by name."""
    flags = _load("xla_compile_flags")
    report = flags.main(["--repeats", "1", "--flags=--xla_cpu_use_fusion_emitters=false", "--out",
                         str(tmp_path / "flags.json")])  # fmt: skip
    (run,) = report["runs"]
    assert run["flags"] == "--xla_cpu_use_fusion_emitters=false" and run["backend_compile_duration"] > 0
    assert run["jit(plain_loop)"] > 0 and run["jit(speculative_loop)"] > 0
    with pytest.raises(SystemExit, match="--xla_no_such_flag"):
        flags.main(["--repeats", "1", "--flags=--xla_no_such_flag=1"])
