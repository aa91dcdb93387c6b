"""The EAGLE-3 head shipped for SmolLM2: it loads, it is small, it drafts well, and decoding with it stays exact."""

import pathlib

import numpy as np
import pytest
from scipy import stats
from stats_util import LEVEL

from jspec.analysis.check import two_sample_chi2
from jspec.core.sampling import SamplingParams
from jspec.core.tree import DynamicTreeSpec, StaticTree
from jspec.drafters import EagleDrafter
from jspec.heads.eagle import load_head
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.models.hub import shipped_head

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


@pytest.fixture(scope="module")
def head_and_model(smollm2):
    model, tok = smollm2
    return load_head(shipped_head("smollm2-135m", "eagle3"), model), model, tok


def test_shipped_head_is_small_and_says_how_it_was_made():
    folder = shipped_head("smollm2-135m", "eagle3")
    assert sum(p.stat().st_size for p in pathlib.Path(folder).iterdir()) < 30 * 2**20
    assert (folder / "README.md").exists()


@pytest.mark.parametrize("tree", [None, DynamicTreeSpec(top_k=4, depth=4, total=16)], ids=["chain5", "dynamic"])
def test_greedy_with_the_shipped_head_equals_plain_greedy(head_and_model, tree):
    head, model, tok = head_and_model
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))]
    plain = Decoder(model, eos_ids=tok.eos_token_ids).generate(ids, 64)
    drafter = EagleDrafter.from_head(head, model, num_draft=None if tree else 5, tree=tree)
    got = SpeculativeDecoder(model, drafter, eos_ids=tok.eos_token_ids).generate(ids, 64)
    assert got.tokens == plain.tokens
    # An untrained head's drafts are almost never accepted (tau 1.0-1.05 in our runs); the shipped
    # head (its third version) gave 1.52 (chain) and 2.25 (dynamic tree) on this prompt on 2026-11-30.
    assert got.tau > 1.25


def test_speculator_with_the_shipped_head_writes_the_plain_greedy_text(head_and_model):
    """The text-level call, the way the README shows it: the same text as plain greedy decoding."""
    import jspec

    _, model, tok = head_and_model
    out = jspec.Speculator(model, tok, drafter="eagle3", model_name="smollm2-135m", num_draft=5).generate(
        [PROMPT], chat=True, max_new_tokens=64
    )
    plain = jspec.Speculator(model, tok, drafter="ar").generate([PROMPT], chat=True, max_new_tokens=64)
    assert out.texts == plain.texts and out.tokens == plain.tokens and len(out.tokens[0]) > 8
    assert out.stats["tau"] > 1.25


@pytest.mark.slow
def test_dynamic_tree_at_temperature_one_matches_plain_sampling(head_and_model):
    """Tokens 2-4 of 600 rows decoded with a small static tree against 600 plain rows, chi-square.

    Passed on 2026-11-30 (252 s). The negative control (a verifier that draws the correction
    from q instead of the residual) is asserted on toy chains in test_tree.py; here, on this
    prompt and size, it gave p = 0.076 (2026-11-30), so it is not asserted: too few rejections
    that the residual changes to expose it with 600 rows.
    """
    head, model, tok = head_and_model
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a color."}]))
    rows, params = 600, SamplingParams.create(temperature=1.0)
    plain = np.array(Decoder(model).generate([ids] * rows, 4, params, seed=1).tokens)
    drafter = EagleDrafter.from_head(head, model, tree=StaticTree.from_branching([2, 2]))
    spec = np.array(SpeculativeDecoder(model, drafter).generate([ids] * rows, 4, params, seed=2).tokens)
    vocab = model.config.vocab_size
    chi2, dof = 0.0, 0
    for j in (1, 2, 3):
        c, d = two_sample_chi2(np.bincount(spec[:, j], minlength=vocab), np.bincount(plain[:, j], minlength=vocab))
        chi2, dof = chi2 + c, dof + d
    assert stats.chi2.sf(chi2, dof) > LEVEL
