"""The package's face: make_drafter and its rules, shared defaults, clear errors on bad input, Speculator."""

import jax
import numpy as np
import pytest
from flax import nnx

import jspec
from jspec.core.tree import DynamicTreeSpec, StaticTree
from jspec.drafters import DraftModel, EagleDrafter, PromptLookup
from jspec.heads.eagle import DraftHead, HeadConfig, draft_vocabulary, save_head
from jspec.methods import DEFAULTS, make_drafter, parse_tree
from jspec.models.tiny import tiny_model

V = 97
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=0, num_layers=4)


def _head(target, kind="eagle3"):
    head = DraftHead(HeadConfig.for_target(target.config, kind, draft_vocab_size=40), rngs=nnx.Rngs(1))
    head.attach_target(target, draft_vocabulary(np.arange(V)[::-1], 40))
    return head


def test_make_drafter_builds_each_method(target, tmp_path):
    lookup = make_drafter("ngram", target, num_draft=3)
    assert lookup == PromptLookup(num_draft=3, max_ngram=DEFAULTS.ngram_max, min_ngram=DEFAULTS.ngram_min)
    assert make_drafter("ngram", target, tree="3,1,1").num_paths == 3
    draft = make_drafter("draft", target, draft_model=tiny_model("qwen2", seed=1, num_layers=1), tree=[2, 2])
    assert isinstance(draft, DraftModel) and draft.num_nodes == 7
    save_head(_head(target), tmp_path / "head")
    eagle = make_drafter("eagle3", target, head=tmp_path / "head", tree="dynamic")  # a folder, loaded
    assert isinstance(eagle, EagleDrafter) and eagle.tree == DynamicTreeSpec() and eagle.num_draft == 3


@pytest.mark.parametrize(
    ("method", "options", "message"),
    [
        ("eagle9", {}, "unknown method"),
        ("ar", {}, "plain decoding"),
        ("ngram", {"tree": "2,2,2"}, "M,1,...,1"),
        ("ngram", {"ngram_min": 4, "ngram_max": 3}, "ngram_min <= ngram_max"),
        ("draft", {}, "needs a draft model"),
        ("eagle3", {}, "needs a head"),
        ("ngram", {"tree": "2,x"}, "branching"),
        ("ngram", {"num_draft": 0}, "num_draft"),
        ("ngram", {"num_draft": 5, "tree": "3,1,1"}, "conflicts with the tree"),
    ],
)
def test_make_drafter_refuses_what_a_method_cannot_do(target, method, options, message):
    with pytest.raises(ValueError, match=message):
        make_drafter(method, target, **options)


def test_draft_models_draft_no_dynamic_trees_and_heads_keep_their_kind(target, tmp_path):
    with pytest.raises(ValueError, match="static trees"):
        make_drafter("draft", target, draft_model=target, tree="dynamic")
    save_head(_head(target, "eagle1"), tmp_path / "h1")
    with pytest.raises(ValueError, match="eagle1 head"):
        make_drafter("eagle3", target, head=tmp_path / "h1")
    with pytest.raises(ValueError, match="nothing': no such folder, and not a Hub id"):
        EagleDrafter.from_head(tmp_path / "nothing", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no draft head jspec knows"):
        EagleDrafter.from_head(tmp_path / "empty", target)


def test_one_default_per_knob_for_python_and_the_command_line():
    from jspec.cli.main import build_parser

    assert parse_tree("dynamic") == DynamicTreeSpec() == DynamicTreeSpec(4, 3, 8)
    assert parse_tree("2,2") == parse_tree([2, 2]) == StaticTree.from_branching([2, 2]) and parse_tree("chain") is None
    for command in (["generate", "--prompt", "x"], ["bench"]):
        args = vars(build_parser().parse_args(command))
        assert args["num_draft"] is None  # the shared default for a chain, a tree's own depth for a tree
        # None: the library's default (a knob given to a method that does not take it is refused, so "given" must
        # show): N, prompt lookup's and Lookahead's knobs; the tree's sizes build the tree --tree names.
        unset = {k: None for k in DEFAULTS.__dataclass_fields__ if not k.startswith("tree_")}
        assert {knob: args[knob] for knob in DEFAULTS.__dataclass_fields__} == DEFAULTS.__dict__ | unset
    assert make_drafter("ngram", None).num_draft == DEFAULTS.num_draft
    lookahead = make_drafter("lookahead", None)
    assert (lookahead.window, lookahead.level, lookahead.guesses, lookahead.pool_size) == (
        DEFAULTS.lookahead_window,
        DEFAULTS.lookahead_level,
        DEFAULTS.lookahead_guesses,
        DEFAULTS.lookahead_pool,
    )


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ("Why is the sky blue?", "got a string"),
        ([5, 6, 7], "flat list of token ids"),
        (["Why is the sky blue?"], "prompt 0 is a string"),
        ([["Why", "is"]], "prompt 0 must be a list of integer token ids; it holds 'Why'"),
        ([[5, 6], [7, 1.5]], "prompt 1 must be a list of integer token ids; it holds 1.5"),
        ([], "no prompts"),
    ],
)
def test_bad_prompts_are_clear_errors_before_anything_compiles(target, prompts, message):
    for decoder in (jspec.Decoder(target), jspec.SpeculativeDecoder(target, PromptLookup(num_draft=2))):
        with pytest.raises(ValueError, match=message):
            decoder.generate(prompts, 8)


def test_array_prompts_are_read_as_token_lists(target):
    import jax.numpy as jnp

    want = jspec.Decoder(target).generate(PROMPTS, 6).tokens
    rows = [jnp.asarray(PROMPTS[0]), np.asarray(PROMPTS[1], np.int32)]
    assert jspec.Decoder(target).generate(rows, 6).tokens == want
    assert jspec.Decoder(target).generate(jnp.asarray([PROMPTS[0][:3], PROMPTS[1]]), 6).tokens[1] == want[1]


def test_every_result_has_tau_and_the_same_stats(target):
    plain = jspec.Decoder(target).generate(PROMPTS, 8)
    spec = jspec.SpeculativeDecoder(target, PromptLookup(num_draft=2)).generate(PROMPTS, 8)
    assert plain.tau == 1.0 and not plain.speculative and spec.speculative
    assert {"tau", "tokens_per_s", "new_tokens"} <= plain.stats().keys() <= spec.stats().keys()
    total = jspec.GenerationResult.total([spec, spec])
    assert total.tau == spec.tau and total.new_tokens == 2 * spec.new_tokens


class _Tokenizer:
    """Characters as token ids (4 + ord mod 90): enough of a tokenizer for the text-level call."""

    eos_token_ids = (3,)

    def encode(self, text):
        return [4 + ord(c) % 90 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages):
        return "<user>" + messages[0]["content"] + "<assistant>"


def test_speculator_takes_and_returns_text(target):
    tok = _Tokenizer()
    plain = jspec.Speculator(target, tok, drafter="ar").generate(["abcabcabc", "xyz"], max_new_tokens=12, chat=True)
    spec = jspec.Speculator(target, tok, drafter="ngram", num_draft=3).generate(["abcabcabc", "xyz"], max_new_tokens=12,
                                                                                chat=True)  # fmt: skip
    assert spec.texts == plain.texts and spec.tokens == plain.tokens and len(spec.texts) == 2
    assert spec.prompt_tokens == [
        len(tok.encode("<user>abcabcabc<assistant>")),
        len(tok.encode("<user>xyz<assistant>")),
    ]
    assert spec.stats["tau"] >= 1.0 and plain.stats["tau"] == 1.0
    built = jspec.Speculator(target, tok, drafter=jspec.make_drafter("ngram", target)).generate("abc", max_new_tokens=4)
    assert built.texts == jspec.Speculator(target, tok, drafter=None).generate("abc", max_new_tokens=4).texts
    with pytest.raises(ValueError, match="tokenizer"):
        jspec.Speculator(target, drafter="ngram")
    with pytest.raises(ValueError, match="list of strings"):
        jspec.Speculator(target, tok, drafter="ar").generate([[5, 6]])
    with pytest.raises(ValueError, match="method 'ar' takes no options; not num_draft"):
        jspec.Speculator(target, tok, drafter="ar", num_draft=3)


def test_the_package_exports_what_a_script_needs():
    for name in ("load_model", "Decoder", "SpeculativeDecoder", "make_drafter", "SamplingParams", "Speculator"):
        assert hasattr(jspec, name)
    assert jax.tree.leaves(jspec.PromptLookup(num_draft=2)) == []
