"""EAGLE on the real SmolLM2: the tiny training recipe end to end, then exact greedy decoding with the head
(a chain, a static tree and a dynamic tree), then fine-tuning from it."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from jspec.cli.main import main
from jspec.heads.eagle import load_head
from jspec.training.recipe import Recipe, load_extra_data, train_head


@pytest.mark.slow  # 58 s; greedy EAGLE-3 on SmolLM2 = plain: test_real_shipped_head.py; training: test_eagle.py
def test_tiny_training_run_then_greedy_eagle_equals_plain(smollm2, tmp_path, capsys):
    out = tmp_path / "head"
    assert main(["train", "eagle3", "--model", "smollm2-135m", "--tiny", "--out", str(out), "--eval-prompts", "1",
                 "--eval-tokens", "16", "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["report"]["steps"] == 12 and (out / "head.safetensors").exists()
    assert report["evaluation"]["tau"] >= 1.0
    assert len(report["report"]["final"]["loss"]) == 2  # one loss per TTT step
    # Greedy equality of a saved head through `generate --head` on SmolLM2 is test_real_shipped_head's (chains
    # and a dynamic tree); static trees are test_tree_engine's.
    _fine_tuning_starts_from_the_saved_head_and_joins_extra_data(smollm2, out, tmp_path)


def _fine_tuning_starts_from_the_saved_head_and_joins_extra_data(smollm2, out, tmp_path):
    """--init and --extra-data, on the data and head the tiny run above made (no new generation)."""
    model, tokenizer = smollm2
    recipe = dataclasses.replace(Recipe.tiny(), init_from=str(out))
    head, report = train_head(model, tokenizer, recipe, tmp_path / "ft", model_name="smollm2-135m",
                              data_dir=out / "data", extra_data=[out / "data"], progress=False, until=0)  # fmt: skip
    saved = load_head(out, model)
    assert report["examples"] == 16 and report["extra_data"][0]["examples"] == 8
    np.testing.assert_array_equal(np.asarray(head.d2t[...]), np.asarray(saved.d2t[...]))
    leaves = [jax.tree.leaves(nnx.state(h, nnx.Param)) for h in (head, saved)]
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="cannot join"):
        load_extra_data([out / "data"], {}, {"model": "smollm2-135m", "feature_layers": [1, 2, 3], "seq_len": 128})
