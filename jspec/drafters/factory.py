"""From a method name to a drafter: the one place that knows which drafter drafts which trees.

The command line, :class:`jspec.Speculator` and the benchmark scripts all build their
drafters here, with the same defaults (:data:`DEFAULTS`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from jspec.drafters.base import DEFAULT_NUM_DRAFT, draft_depth
from jspec.tree import DynamicTreeSpec, MeasuredTree, StaticTree

__all__ = ["DEFAULTS", "DRAFT_METHODS", "METHODS", "Defaults", "check_options", "make_drafter", "parse_tree"]

METHODS = ("ar", "ngram", "draft", "eagle3", "eagle1", "medusa", "lookahead")
DRAFT_METHODS = METHODS[1:]  # "ar" is plain decoding: no drafter


@dataclasses.dataclass(frozen=True)
class Defaults:
    """One default per knob, shared by the Python API and the command line.

    ``ngram_min`` 2 skips matches of one repeated token: on SmolLM2 and HumanEval they were
    accepted a third as often as longer ones (BENCHMARKS.md, prompt lookup n-grams). The
    dynamic tree's size is :class:`jspec.tree.DynamicTreeSpec`'s default. Lookahead decoding's
    W 1, N 2, G 2 measured fastest of 11 small settings on SmolLM2 here (a 4-token forward costs
    1.3 plain steps, a 5-token one 1.6-1.8; BENCHMARKS.md, Lookahead grid); the paper's A100 setting
    for 7B models, W 15, N 5, G 15, pays where a forward of ~120 tokens costs about one step.
    """

    num_draft: int = DEFAULT_NUM_DRAFT
    ngram_min: int = 2
    ngram_max: int = 3
    tree_top_k: int = DynamicTreeSpec.top_k
    tree_depth: int = DynamicTreeSpec.depth
    tree_nodes: int = DynamicTreeSpec.total
    lookahead_window: int = 1
    lookahead_level: int = 2
    lookahead_guesses: int = 2
    lookahead_pool: int = 256


DEFAULTS = Defaults()


def parse_tree(tree, *, top_k: int | None = None, depth: int | None = None, total: int | None = None):
    """A draft shape from what a user writes: None or "chain" (a chain), "dynamic" (EAGLE-2, with
    ``top_k``, ``depth``, ``total`` or their defaults), "measured" (Medusa: the best static tree of
    at most ``total`` nodes, the dynamic tree's size by default, for the heads' measured acceptance), a
    branching such as "2,2,2" or [2, 2, 2], or a tree object as it is."""
    if tree is None or tree == "chain":
        return None
    if isinstance(tree, StaticTree | DynamicTreeSpec):
        return tree
    if isinstance(tree, MeasuredTree):
        return tree
    if tree == "measured":
        return MeasuredTree(total or DEFAULTS.tree_nodes)
    if tree == "dynamic":
        d = DEFAULTS
        return DynamicTreeSpec(top_k or d.tree_top_k, depth or d.tree_depth, total or d.tree_nodes)
    if isinstance(tree, str):
        try:
            tree = [int(x) for x in tree.split(",")]
        except ValueError:
            raise ValueError(
                f"tree must be 'chain', 'dynamic', 'measured' or a branching list such as 2,2,2; got {tree!r}."
            ) from None
    if isinstance(tree, Sequence) and all(isinstance(x, int) for x in tree):
        return StaticTree.from_branching(tree)
    raise ValueError(f"tree must be 'chain', 'dynamic', a branching such as [2, 2, 2], a StaticTree or a "
                     f"DynamicTreeSpec; got {tree!r}.")  # fmt: skip


def _lookup_paths(tree) -> int | None:
    """M for a static tree shaped M,1,...,1 (prompt lookup's tree of M continuations), else None."""
    if isinstance(tree, StaticTree) and tree.branching and all(b == 1 for b in tree.branching[1:]):
        return tree.branching[0]
    return None


def check_options(methods: Sequence[str], *, tree=None, ngram_min: int = DEFAULTS.ngram_min,
                  ngram_max: int = DEFAULTS.ngram_max, draft_model=None) -> None:  # fmt: skip
    """Which methods exist and which draft which trees; raises ValueError before any model is loaded."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise ValueError(f"unknown method(s) {unknown or list(methods)}; choose from {', '.join(METHODS)}.")
    if "ngram" in methods and not 1 <= ngram_min <= ngram_max:
        raise ValueError(f"prompt lookup needs 1 <= ngram_min <= ngram_max; got {ngram_min} and {ngram_max}.")
    if "draft" in methods and draft_model is None:
        raise ValueError("method 'draft' needs a draft model (a smaller model with the target's tokenizer).")
    tree = parse_tree(tree)
    if "lookahead" in methods and tree is not None:
        raise ValueError(f"Lookahead decoding verifies a trie of its pool's n-grams, shaped by --lookahead-guesses "
                         f"and --lookahead-level; it takes no --tree (got {tree}).")  # fmt: skip
    if tree is None:
        return
    if isinstance(tree, MeasuredTree) and set(methods) != {"medusa"}:
        raise ValueError("a measured tree is chosen from Medusa heads' measured acceptance; only method medusa "
                         f"drafts one (asked for {', '.join(methods)}).")  # fmt: skip
    if "draft" in methods and not isinstance(tree, StaticTree):
        raise ValueError(f"a draft model drafts static trees (a branching list such as 2,2,2) or chains; got {tree}.")
    if "medusa" in methods and not isinstance(tree, StaticTree | MeasuredTree):
        raise ValueError(f"Medusa heads draft static trees (a branching list such as 3,2,1: head d's top tokens at "
                         f"depth d; or 'measured') or chains; got {tree}.")  # fmt: skip
    if "ngram" in methods and _lookup_paths(tree) is None:
        raise ValueError(f"prompt lookup drafts chains or trees of several continuations, M,1,...,1 (M paths of "
                         f"equal depth); got {tree}.")  # fmt: skip


def make_drafter(
    method: str,
    target,
    *,
    num_draft: int | None = None,
    tree=None,
    head=None,
    draft_model=None,
    ngram_min: int = DEFAULTS.ngram_min,
    ngram_max: int = DEFAULTS.ngram_max,
    model_name: str | None = None,
    lookahead: dict | None = None,
):
    """The drafter for a method, ready for :class:`jspec.SpeculativeDecoder`.

    Args:
      method: "ngram" (prompt lookup), "draft" (a separate draft model), "eagle3", "eagle1" or "medusa".
      target: the target model.
      num_draft: N for a chain (default :data:`DEFAULTS`); a tree's depth is its own (leave it out).
      tree: a chain (None), "dynamic", a branching such as "2,2,2", or a tree object (:func:`parse_tree`).
      head: EAGLE: a :class:`jspec.heads.DraftHead`; Medusa: :class:`jspec.medusa.MedusaHeads` (N defaults
        to every head); or the folder or Hub id ``ORG/NAME[@REVISION]`` of a head saved by jspec or published
        by SafeAILab/EAGLE, SpecForge, speculators or Medusa (:mod:`jspec.head_formats`); default the head
        shipped for ``model_name``.
      draft_model: "draft": a model, or a registry name or folder to load.
      ngram_min, ngram_max: prompt lookup's shortest and longest suffix.
      model_name: the target's registry name (finds the shipped head).
      lookahead: Lookahead decoding's knobs, any of ``window``, ``level``, ``guesses``, ``pool_size``,
        ``prompt_ngrams`` (:class:`jspec.drafters.LookaheadDecoding`; :data:`DEFAULTS` for the rest).
    """
    check_options([method], tree=tree, ngram_min=ngram_min, ngram_max=ngram_max, draft_model=draft_model)
    if method == "ar":
        raise ValueError("method 'ar' is plain decoding and has no drafter; use jspec.Decoder (or jspec.make_decoder).")
    if lookahead and method != "lookahead":
        raise ValueError(f"lookahead options are for method lookahead, not {method!r}; drop them.")
    tree = parse_tree(tree)
    if method == "lookahead":
        from jspec.drafters.lookahead import LookaheadDecoding

        if num_draft is not None:
            raise ValueError("Lookahead decoding drafts n-grams of lookahead level - 1 tokens; set its level, not "
                             "num_draft.")  # fmt: skip
        d = DEFAULTS
        knobs = {"window": d.lookahead_window, "level": d.lookahead_level, "guesses": d.lookahead_guesses,
                 "pool_size": d.lookahead_pool} | (lookahead or {})  # fmt: skip
        return LookaheadDecoding(**knobs)
    if method == "medusa":
        from jspec.drafters.medusa import MedusaDrafter

        head = _shipped_if_none(head, method, model_name)
        return MedusaDrafter.from_heads(head, target, num_draft=num_draft, tree=tree)
    num_draft = draft_depth(num_draft, tree)
    if method == "ngram":
        from jspec.drafters.prompt_lookup import PromptLookup

        paths = 1 if tree is None else _lookup_paths(tree)
        return PromptLookup(num_draft=num_draft, max_ngram=ngram_max, min_ngram=ngram_min, num_paths=paths)
    if method == "draft":
        from jspec.drafters.draft_model import DraftModel

        if isinstance(draft_model, str | os.PathLike):
            from jspec.models.hub import load_model

            draft_model, _ = load_model(str(draft_model))
        return DraftModel.from_model(draft_model, target, num_draft=num_draft, tree=tree)
    from jspec.drafters.eagle import EagleDrafter
    from jspec.heads import DraftHead

    head = _shipped_if_none(head, method, model_name)
    if not isinstance(head, DraftHead):  # a folder or Hub id: loaded once, its kind read from the loaded head
        from jspec.head_formats import load_eagle

        head = load_eagle(head, target)
    if head.config.kind != method:
        raise ValueError(f"method {method!r} was asked for, but the head is an {head.config.kind} head; "
                         f"pass method={head.config.kind!r}.")  # fmt: skip
    return EagleDrafter.from_head(head, target, num_draft=num_draft, tree=tree)


def _shipped_if_none(head, method: str, model_name: str | None):
    """``head``, or the head shipped for ``model_name`` and ``method``."""
    if head is not None:
        return head
    if model_name is None:
        raise ValueError(f"method {method!r} needs a head: pass head= (heads or a saved head's folder), "
                         "or model_name= to use the head shipped for that model.")  # fmt: skip
    from jspec.models.hub import shipped_head

    return shipped_head(model_name, method)
