"""The jspec command line: --json output, exit status, clear errors."""

import json
import shutil
import subprocess
import sys

import pytest
from conftest import xla_flags

from jspec.cli.main import main


def _json(capsys, argv):
    code = main(argv)
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_speedup_json(capsys):
    code, out = _json(capsys, ["speedup", "--alpha", "0.8", "--cost-ratio", "0.05", "--json"])
    assert code == 0
    assert out["best_n"] == 8 and out["n"] == 8
    assert out["expected_tokens"] == pytest.approx(4.32891136)
    assert out["speedup"] == pytest.approx(4.32891136 / 1.4)


def test_speedup_fixed_n_and_verify_cost(capsys):
    argv = ["speedup", "--alpha", "0.9", "--cost-ratio", "0.04", "--n", "5", "--verify-cost", "2.5", "--json"]
    code, out = _json(capsys, argv)
    assert code == 0 and out["n"] == 5
    assert out["speedup"] == pytest.approx((1 - 0.9**6) / 0.1 / (2.5 + 0.2))
    assert out["best_n"] >= 5


def test_speedup_text(capsys):
    assert main(["speedup", "--alpha", "0.2", "--cost-ratio", "0.9", "--verify-cost", "2"]) == 0
    assert "slower than plain decoding" in capsys.readouterr().out


def test_check_json_passes(capsys):
    code, out = _json(capsys, ["check", "--steps", "5000", "--num-draft", "3", "--vocab", "8", "--json"])
    assert code == 0
    assert {"chi2", "critical", "dof", "passed", "acceptance_rate"} <= out.keys()
    assert out["passed"] is True and out["chi2"] <= out["critical"]


def test_check_negative_control_exits_nonzero(capsys):
    code, out = _json(capsys, ["check", "--steps", "20000", "--negative-control", "--json"])
    assert code == 1 and out["passed"] is False


def test_bad_input_is_a_clear_error(capsys):
    assert main(["speedup", "--alpha", "1.5", "--cost-ratio", "0.1"]) == 2
    assert "alpha" in capsys.readouterr().err
    code, out = _json(capsys, ["check", "--distance", "2", "--json"])
    assert code == 2 and "distance" in out["error"]
    with pytest.raises(SystemExit):
        main(["check", "--num-draft", "0"])


def test_console_script_is_installed():
    exe = shutil.which("jspec") or str(__import__("pathlib").Path(sys.executable).with_name("jspec"))
    proc = subprocess.run(
        [exe, "speedup", "--alpha", "0.7", "--cost-ratio", "0.1", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(proc.stdout)["best_n"] >= 1


def test_generate_json_on_the_real_model(capsys, smollm2):
    argv = [
        "generate",
        "--model",
        "smollm2-135m",
        "--prompt",
        "What is 2+2?",
        "--chat",
        "--max-new-tokens",
        "8",
        "--json",
    ]
    code, out = _json(capsys, argv)
    assert code == 0
    assert isinstance(out["text"], str) and 1 <= len(out["tokens"]) <= 8
    assert {"new_tokens", "seconds", "tokens_per_s", "compile_seconds", "target_calls"} <= out["stats"].keys()
    assert out["stats"]["new_tokens"] == len(out["tokens"])


def test_train_bad_input(capsys, tmp_path):
    (tmp_path / "head.json").write_text("{}")
    argv = ["train", "eagle3", "--out", str(tmp_path / "o"), "--init", str(tmp_path), "--warm-start"]
    assert main(argv) == 2
    assert "pass one of them" in capsys.readouterr().err
    assert main(["train", "eagle3", "--out", str(tmp_path / "o"), "--init", str(tmp_path / "none")]) == 2
    assert "no saved head" in capsys.readouterr().err


def test_generate_bad_input(capsys):
    assert main(["generate", "--model", "nope", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "known models" in err and "Hugging Face model folder" in err
    assert main(["generate", "--prompt", "x", "--stream", "--json"]) == 2
    assert "--stream" in capsys.readouterr().err
    assert main(["generate", "--prompt", ""]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--method", "eagle3", "--tree", "two", "--prompt", "x"]) == 2
    assert "branching list" in capsys.readouterr().err
    assert main(["generate", "--method", "ngram", "--ngram-min", "3", "--ngram-max", "2", "--prompt", "x"]) == 2
    assert "prompt lookup needs 1 <= ngram_min <= ngram_max; got 3 and 2" in capsys.readouterr().err
    assert main(["generate", "--method", "ngram", "--tree", "2,2,2", "--prompt", "x"]) == 2
    assert "M,1,...,1" in capsys.readouterr().err
    assert main(["generate", "--method", "draft", "--draft-model", "x", "--tree", "dynamic", "--prompt", "x"]) == 2
    assert "method 'draft' drafts chains or static trees" in capsys.readouterr().err
    argv = ["generate", "--method", "eagle3", "--tree", "dynamic", "--tree-nodes", "99", "--prompt", "x"]
    assert main(argv) == 2
    assert "total" in capsys.readouterr().err
    assert main(["generate", "--method", "eagle3", "--tree", "dynamic", "--num-draft", "5", "--prompt", "x"]) == 2
    assert "conflicts with the tree" in capsys.readouterr().err
    assert main(["generate", "--method", "draft", "--prompt", "x"]) == 2
    assert "--draft-model" in capsys.readouterr().err


@pytest.mark.slow  # 20 s; the same stats through the API in test_api.py, --json above on plain decoding
def test_generate_ngram_reports_speculation_stats(capsys, smollm2):
    argv = ["generate", "--method", "ngram", "--num-draft", "3", "--prompt", "a b c a b c a b", "--max-new-tokens", "8"]
    code, out = _json(capsys, [*argv, "--json"])
    assert code == 0
    assert {"tau", "acceptance_by_position", "target_calls"} <= out["stats"].keys()
    assert len(out["stats"]["acceptance_by_position"]) == 3


@pytest.mark.slow  # 40 s; run_interleaved and the speedup intervals are tested in test_bench.py and test_auto.py
def test_bench_json(capsys, smollm2, tmp_path):
    path = tmp_path / "question.jsonl"
    turns = ["Repeat exactly: one two three one two three one two three", "Say hello."]
    path.write_text(
        "\n".join(json.dumps({"question_id": i, "category": "t", "turns": [t]}) for i, t in enumerate(turns))
    )
    argv = ["bench", "--methods", "ar,ngram", "--prompts", str(path), "--limit", "2", "--max-new-tokens", "12"]
    code, out = _json(capsys, [*argv, "--json"])
    assert code == 0 and out["num_prompts"] == 2
    assert set(out["methods"]) == {"ar", "ngram"}
    for entry in out["methods"].values():
        assert {"tau", "tokens_per_s", "speedup"} <= entry.keys()
    assert out["methods"]["ar"]["speedup"] == 1.0
    assert main(["bench", "--methods", "ar,eagle9", "--prompts", str(path)]) == 2
    capsys.readouterr()
    plot = tmp_path / "bench.png"
    assert main([*argv[:2], "ar", *argv[3:], "--plot", str(plot)]) == 0  # one method: the table and plot paths
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tokens/s" in capsys.readouterr().out  # the table without --json


def test_stream_printer_shows_the_text_as_it_comes():
    """generate --stream's printer on a tiny model: pieces per loop step, the same text at the end."""
    import io

    from tokenizers import Tokenizer, models, pre_tokenizers

    from jspec.cli.common import stream_printer
    from jspec.loop.decode import Decoder
    from jspec.models.tiny import tiny_model
    from jspec.models.tokenizer import TextTokenizer

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    words.decoder = decoders.WordPiece(prefix="##")
    tok = TextTokenizer(words, eos_token_ids=())
    out = io.StringIO()
    printer = stream_printer(tok, out)
    shown = []
    real = printer._show
    printer._show = lambda text: (shown.append(text), real(text))
    result = Decoder(tiny_model()).generate([[5, 6, 7]], 12, on_tokens=printer)
    printer.finish(tok.decode(result.tokens[0]))
    assert out.getvalue() == tok.decode(result.tokens[0]) + "\n"
    assert len(shown) == 12  # the prefill's token, then one piece per loop step


def test_speedup_plot_and_help_defaults(capsys, tmp_path):
    plot = tmp_path / "speedup.png"
    assert main(["speedup", "--alpha", "0.8", "--cost-ratio", "0.1", "--plot", str(plot), "--json"]) == 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 8)" in text and "(default: ar,ngram)" in text


MESH_CLI = r"""
import json, sys
from jspec.cli.main import main
base = ["generate", "--prompt", "What is 2+2?", "--chat", "--max-new-tokens", "8", "--json"]
codes = [main([*base, "--mesh", "data=2,model=3"]), main([*base, "--mesh", "data=3,model=2"])]
print(json.dumps(codes))
"""


@pytest.mark.slow  # 50 s; meshes give the one-device tokens in test_sharding.py (a mesh fixture and two processes)
def test_generate_over_a_mesh_gives_the_one_device_tokens(capsys, smollm2):
    """SmolLM2 split over 3 of 6 simulated devices (9 heads, 3 KV heads: 3 per device) and 2 rows' worth of data."""
    import os
    import pathlib

    code, one = _json(capsys, ["generate", "--prompt", "What is 2+2?", "--chat", "--max-new-tokens", "8", "--json"])
    assert code == 0
    env = dict(os.environ, XLA_FLAGS=xla_flags(6),
               PYTHONPATH=str(pathlib.Path(__file__).parent))  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", MESH_CLI], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert json.loads(lines[-1]) == [0, 2]
    assert json.loads(lines[0])["tokens"] == one["tokens"]
    assert "mesh model=2 does not split this model (9 attention heads, 3 KV heads" in proc.stderr
    assert "Sizes that fit: model=1, 3." in proc.stderr  # 9 does not divide its MLP width, 1,536


def test_mesh_options_are_checked_before_the_model_loads(capsys):
    assert main(["generate", "--prompt", "x", "--mesh", "data=2,tensor=2"]) == 2
    assert "--mesh takes data=D,model=M" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--mesh", "data=4"]) == 2
    assert "needs 4 devices; 1 are visible" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--mesh", "data=1", "--coordinator", "localhost:1"]) == 2
    assert "all of --coordinator HOST:PORT, --num-processes N and --process-id I" in capsys.readouterr().err
    argv = ["generate", "--prompt", "x", "--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "0"]
    assert main(argv) == 2
    assert "give --mesh too" in capsys.readouterr().err


def test_the_command_line_reference_is_the_parsers_help(monkeypatch):
    """docs/cli.md is what `make docs` writes from the parsers; a changed flag makes it stale (negative control)."""
    import pathlib

    from jspec.cli import main as cli

    docs = pathlib.Path(__file__).parent.parent / "docs" / "cli.md"
    assert docs.read_text() == cli.reference() + "\n", "docs/cli.md is stale: run `make docs`"
    assert "## `jspec tune profile`" in docs.read_text() and "--draft-model" in docs.read_text()
    build = cli.build_parser

    def with_extra_flag():
        parser = build()
        parser.add_argument("--new-flag", help="added after make docs")
        return parser

    monkeypatch.setattr(cli, "build_parser", with_extra_flag)
    assert docs.read_text() != cli.reference() + "\n"
