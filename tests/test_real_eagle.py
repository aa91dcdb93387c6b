"""EAGLE on the real SmolLM2: the tiny training recipe end to end, then exact greedy decoding with the head
(a chain, a static tree and a dynamic tree)."""

import json

from jspec.cli import main


def test_tiny_training_run_then_greedy_eagle_equals_plain(smollm2, tmp_path, capsys):
    out = tmp_path / "head"
    assert main(["train", "eagle3", "--model", "smollm2-135m", "--tiny", "--out", str(out), "--eval-prompts", "1",
                 "--eval-tokens", "16", "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["report"]["steps"] == 12 and (out / "head.safetensors").exists()
    assert report["evaluation"]["tau"] >= 1.0
    assert len(report["report"]["final"]["loss"]) == 2  # one loss per TTT step
    prompt = ["--model", "smollm2-135m", "--prompt", "List three prime numbers.", "--chat", "--max-new-tokens", "24"]
    assert main(["generate", *prompt, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", *prompt, "--method", "eagle3", "--head", str(out), "--num-draft", "3", "--json"]) == 0
    eagle = json.loads(capsys.readouterr().out)
    assert eagle["tokens"] == plain["tokens"]
    assert eagle["stats"]["tau"] >= 1.0
    for tree in (["--tree", "2,2,2"], ["--tree", "dynamic", "--tree-top-k", "3", "--tree-depth", "3"]):
        assert main(["generate", *prompt, "--method", "eagle3", "--head", str(out), *tree, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["tokens"] == plain["tokens"], tree
