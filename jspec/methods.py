"""What a decoding method is: one frozen spec per method, with its options, defaults and checks.

=============  =====================  =========================================================
name           spec                   options
=============  =====================  =========================================================
``ar``         :class:`PlainSpec`         (none)
``ngram``      :class:`PromptLookupSpec`  ``num_draft`` or ``tree`` (M,1,...,1), ``ngram_min``, ``ngram_max``
``draft``      :class:`DraftModelSpec`    ``draft_model`` (required), ``num_draft`` or a static ``tree``
``eagle3``     :class:`Eagle3Spec`        ``head`` (default: the one shipped), ``num_draft`` or ``tree``
``eagle1``     :class:`Eagle1Spec`        as ``eagle3``
``medusa``     :class:`MedusaSpec`        ``head``, ``num_draft`` or a static or measured ``tree``
``lookahead``  :class:`LookaheadSpec`     ``window``, ``level``, ``guesses``, ``pool_size``, ``prompt_ngrams``
``auto``       :class:`AutoSpec`          ``config``, ``workload``, ``profile``, ``head``, ``draft_model``
=============  =====================  =========================================================

:func:`parse` turns a name and options into a spec, refusing an unknown method or an option the
method does not take by name; each spec checks its options when made, before any model is loaded
or anything compiled. ``spec.drafter(target)`` and ``spec.decoder(target, ...)`` build it, and
``spec.to_json()`` / :func:`from_json` round-trip it (a loaded head or model object is refused
there: name it by folder or registry name). This module is the only one that tells methods apart
by name; adding a drafter is its file under :mod:`jspec.drafters` and its spec here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import ClassVar

from jspec.core.tree import DynamicTreeSpec, MeasuredTree, StaticTree, parse_tree, tree_text
from jspec.drafters.base import DEFAULT_NUM_DRAFT, draft_depth
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.eagle import EagleDrafter
from jspec.drafters.lookahead import LookaheadDecoding
from jspec.drafters.medusa import MedusaDrafter
from jspec.drafters.prompt_lookup import PromptLookup
from jspec.heads.eagle import DraftHead
from jspec.heads.formats import load_eagle
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.models.hub import load_model, shipped_head

__all__ = [
    "DEFAULTS", "METHODS", "TUNED", "AutoSpec", "Defaults", "DraftModelSpec", "DraftedSpec", "Eagle1Spec", "Eagle3Spec",
    "LookaheadSpec", "MedusaSpec", "MethodSpec", "PlainSpec", "PromptLookupSpec", "drafts", "from_json", "label_of",
    "make_drafter", "needs_of", "options_of", "parse", "parse_all", "parse_tree", "register", "tree_text",
    "tuned_families",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Defaults:
    """One default per knob, shared by the Python API and the command line.

    ``ngram_min`` 2 skips matches of one repeated token (accepted a third as often as longer ones on
    SmolLM2 and HumanEval). The dynamic tree's size is :class:`jspec.core.tree.DynamicTreeSpec`'s default.
    Lookahead decoding's W 1, N 2, G 2 suit a machine where a 4-token forward costs 1.3 plain steps;
    the paper's W 15, N 5, G 15 pay where a forward of ~120 tokens costs about one step.
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


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A decoding method and its options (see the module docstring); subclasses set ``name``."""

    name: ClassVar[str]
    tuned: ClassVar[bool] = False  # among ``jspec tune``'s candidates (and so ``auto``'s)
    needs: ClassVar[str | None] = None  # the option the tuner cannot try it without (its head, its model)

    def drafter(self, target, *, model_name: str | None = None):
        """The drafter for :class:`jspec.SpeculativeDecoder` (``model_name`` finds a shipped head)."""
        raise ValueError(f"method {self.name!r} has no drafter; build its decoder (spec.decoder(target)).")

    def decoder(self, target, *, eos_ids=(), mesh=None, adaptive=None, costs=None, model_name: str | None = None):
        """A :class:`jspec.SpeculativeDecoder` over :meth:`drafter`, adaptive with ``adaptive`` and ``costs``."""
        drafter = self.drafter(target, model_name=model_name)
        return SpeculativeDecoder(target, drafter, eos_ids=eos_ids, mesh=mesh, adaptive=adaptive, costs=costs)

    @property
    def label(self) -> str:
        """The spec in short, as profiles and results name it: "ar", "ngram:N=3", "eagle3:tree=dynamic"."""
        return self.name

    def to_json(self) -> dict:
        """``{"method": name}`` and the options that differ from their defaults; refuses loaded objects."""
        out = {"method": self.name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if f.name == "tree":
                value = tree_text(value)
            elif not isinstance(value, str | int | float | bool):
                raise ValueError(f"{self.name}'s {f.name} is a loaded {type(value).__name__}; a spec saved as JSON "
                                 "names it by folder, Hub id or registry name.")  # fmt: skip
            out[f.name] = value
        return out


@dataclasses.dataclass(frozen=True)
class PlainSpec(MethodSpec):
    name: ClassVar[str] = "ar"
    tuned: ClassVar[bool] = True

    def drafter(self, target, *, model_name=None):
        raise ValueError("method 'ar' is plain decoding and has no drafter; use jspec.Decoder (or jspec.make_decoder).")

    def decoder(self, target, *, eos_ids=(), mesh=None, adaptive=None, costs=None, model_name: str | None = None):
        if adaptive is not None or costs is not None:
            raise ValueError("plain decoding (ar) has no adaptive policy; pass no adaptive= or costs=.")
        return Decoder(target, eos_ids=eos_ids, mesh=mesh)


@dataclasses.dataclass(frozen=True)
class DraftedSpec(MethodSpec):
    """A drafter of chains (``num_draft``, default 4) or trees (``tree``; N is its depth)."""

    num_draft: int | None = None
    tree: object = None
    trees: ClassVar[tuple[type, ...]] = (StaticTree, DynamicTreeSpec)
    trees_said: ClassVar[str] = "static or dynamic trees"

    def __post_init__(self):
        tree = parse_tree(self.tree)
        if not isinstance(self.tree, StaticTree | DynamicTreeSpec | MeasuredTree):  # text, a list: kept as text
            object.__setattr__(self, "tree", tree_text(tree))
        self.check_tree(tree)
        draft_depth(self.num_draft, tree)  # N >= 1, and no N beside a tree's own depth

    @classmethod
    def check_tree(cls, tree) -> None:
        """Refuses, by name, a tree (:func:`parse_tree`'s) this method does not draft."""
        if tree is not None and not cls.drafts_tree(tree):
            raise ValueError(f"method {cls.name!r} drafts chains or {cls.trees_said}; got {tree}.")

    @classmethod
    def drafts_tree(cls, tree) -> bool:
        return isinstance(tree, cls.trees)

    @property
    def shape(self):
        return parse_tree(self.tree)

    @property
    def label(self) -> str:
        return label_of(self.name, self.num_draft, self.tree)


def _lookup_paths(tree) -> int | None:
    """M for a static tree shaped M,1,...,1 (prompt lookup's tree of M continuations), else None."""
    if isinstance(tree, StaticTree) and tree.branching and all(b == 1 for b in tree.branching[1:]):
        return tree.branching[0]
    return None


@dataclasses.dataclass(frozen=True)
class PromptLookupSpec(DraftedSpec):
    """Prompt lookup: the continuation of the longest suffix (``ngram_min``..``ngram_max`` tokens) seen before."""

    name: ClassVar[str] = "ngram"
    tuned: ClassVar[bool] = True
    ngram_min: int = DEFAULTS.ngram_min
    ngram_max: int = DEFAULTS.ngram_max
    trees_said: ClassVar[str] = "trees of several continuations, M,1,...,1 (M paths of equal depth)"

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"prompt lookup needs 1 <= ngram_min <= ngram_max; got {self.ngram_min} and "
                             f"{self.ngram_max}.")  # fmt: skip

    @classmethod
    def drafts_tree(cls, tree) -> bool:
        return _lookup_paths(tree) is not None

    def drafter(self, target, *, model_name=None):
        paths = 1 if self.shape is None else _lookup_paths(self.shape)
        return PromptLookup(num_draft=draft_depth(self.num_draft, self.shape), max_ngram=self.ngram_max,
                            min_ngram=self.ngram_min, num_paths=paths)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DraftModelSpec(DraftedSpec):
    """A smaller model with the target's tokenizer (a model, registry name or folder)."""

    name: ClassVar[str] = "draft"
    tuned: ClassVar[bool] = True
    needs: ClassVar[str] = "draft_model"
    draft_model: object = None
    trees: ClassVar = (StaticTree,)
    trees_said: ClassVar[str] = "static trees (a branching list such as 2,2,2)"

    def __post_init__(self):
        super().__post_init__()
        if self.draft_model is None:
            raise ValueError("method 'draft' needs a draft model (draft_model=, --draft-model: a smaller model with "
                             "the target's tokenizer).")  # fmt: skip

    def drafter(self, target, *, model_name=None):
        model = self.draft_model
        if isinstance(model, str | os.PathLike):
            model, _ = load_model(str(model))
        return DraftModel.from_model(model, target, num_draft=draft_depth(self.num_draft, self.shape), tree=self.shape)


def _shipped_if_none(head, method: str, model_name: str | None):
    """``head``, or the head shipped for ``model_name`` and ``method``."""
    if head is not None:
        return head
    if model_name is None:
        raise ValueError(f"method {method!r} needs a head: pass head= (heads or a saved head's folder), "
                         "or model_name= to use the head shipped for that model.")  # fmt: skip
    return shipped_head(model_name, method)


@dataclasses.dataclass(frozen=True)
class Eagle3Spec(DraftedSpec):
    """An EAGLE-3 head: a :class:`jspec.heads.eagle.DraftHead`, a folder or Hub id (jspec's or a published
    format, :mod:`jspec.heads.formats`), or None for the head shipped for the target."""

    name: ClassVar[str] = "eagle3"
    tuned: ClassVar[bool] = True
    needs: ClassVar[str] = "head"
    head: object = None

    def drafter(self, target, *, model_name=None):
        head = _shipped_if_none(self.head, self.name, model_name)
        if not isinstance(head, DraftHead):  # a folder or Hub id: loaded once, its kind read from the loaded head
            head = load_eagle(head, target)
        if head.config.kind != self.name:
            raise ValueError(f"method {self.name!r} was asked for, but the head is an {head.config.kind} head; "
                             f"pass method={head.config.kind!r}.")  # fmt: skip
        return EagleDrafter.from_head(head, target, num_draft=draft_depth(self.num_draft, self.shape), tree=self.shape)


@dataclasses.dataclass(frozen=True)
class Eagle1Spec(Eagle3Spec):
    name: ClassVar[str] = "eagle1"


@dataclasses.dataclass(frozen=True)
class MedusaSpec(DraftedSpec):
    """Medusa heads (:class:`jspec.heads.medusa.MedusaHeads`, a folder or Hub id); N defaults to every head."""

    name: ClassVar[str] = "medusa"
    head: object = None
    trees: ClassVar = (StaticTree, MeasuredTree)
    trees_said: ClassVar[str] = "static trees (a branching list such as 3,2,1: head d's top tokens at depth d) or " \
                                "'measured'"  # fmt: skip

    def drafter(self, target, *, model_name=None):
        head = _shipped_if_none(self.head, self.name, model_name)
        return MedusaDrafter.from_heads(head, target, num_draft=self.num_draft, tree=self.shape)

    @property
    def label(self) -> str:
        return super().label if self.num_draft or self.tree else f"{self.name}:N=heads"


@dataclasses.dataclass(frozen=True)
class LookaheadSpec(MethodSpec):
    """Lookahead decoding: n-grams of Jacobi iterations (W columns, level N, G guesses a step)."""

    name: ClassVar[str] = "lookahead"
    window: int = DEFAULTS.lookahead_window
    level: int = DEFAULTS.lookahead_level
    guesses: int = DEFAULTS.lookahead_guesses
    pool_size: int = DEFAULTS.lookahead_pool
    prompt_ngrams: bool = True

    def __post_init__(self):
        self.drafter(None)  # its own checks of W, N, G and the pool, before any model loads

    def drafter(self, target, *, model_name=None):
        return LookaheadDecoding(window=self.window, level=self.level, guesses=self.guesses, pool_size=self.pool_size,
                                 prompt_ngrams=self.prompt_ngrams)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class AutoSpec(MethodSpec):
    """What measured fastest here: :class:`jspec.AutoDecoder`'s options (:func:`jspec.make_decoder` builds it)."""

    name: ClassVar[str] = "auto"
    config: object = None
    workload: str | None = None
    profile: object = None
    head: object = None
    draft_model: object = None

    def decoder(self, target, **_):
        raise ValueError("an auto spec is built by jspec.make_decoder (jspec.AutoDecoder reads tuned settings, "
                         "themselves specs of this module).")  # fmt: skip


_SPECS: dict[str, type[MethodSpec]] = {
    s.name: s
    for s in (PlainSpec, PromptLookupSpec, DraftModelSpec, Eagle3Spec, Eagle1Spec, MedusaSpec, LookaheadSpec, AutoSpec)
}
METHODS = tuple(_SPECS)  # every method name, "auto" last
TUNED = tuple(n for n, s in _SPECS.items() if s.tuned)  # what jspec tune measures and auto runs


def register(spec: type[MethodSpec]) -> type[MethodSpec]:
    """Adds a method (its spec class, named by ``spec.name``) to what :func:`parse` and everything built
    on it know; usable as a class decorator. A name already taken is refused."""
    if spec.name in _SPECS:
        raise ValueError(f"method {spec.name!r} exists already ({_SPECS[spec.name].__name__}).")
    _SPECS[spec.name] = spec
    return spec


def options_of(method: str) -> tuple[str, ...]:
    """The options ``method`` takes."""
    return tuple(f.name for f in dataclasses.fields(_spec_class(method)))


def _spec_class(method: str) -> type[MethodSpec]:
    if method not in _SPECS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}.")
    return _SPECS[method]


def parse(method: str | MethodSpec, **options) -> MethodSpec:
    """The spec of ``method`` with ``options`` (None: not given, the default); an unknown method or an
    option it does not take is refused by name."""
    if isinstance(method, MethodSpec):
        if options:
            raise ValueError(f"options {sorted(options)} are for a method name; {method.label} is a spec already.")
        return method
    cls = _spec_class(method)
    given = {k: v for k, v in options.items() if v is not None}
    extra = sorted(set(given) - set(options_of(method)))
    if extra:
        takes = ", ".join(options_of(method)) or "no options"
        raise ValueError(f"method {method!r} takes {takes}; not {', '.join(extra)}.")
    return cls(**given)


def parse_all(methods: Sequence[str], context: dict | None = None, flags: dict | None = None,
              **options) -> list[MethodSpec]:  # fmt: skip
    """A spec per method, each with the options it takes; an option none of them takes is refused,
    naming the methods that would (the command line's shared flags; ``flags``: option -> the flag
    to name in that message). ``context``: options given to the methods that take them and to no
    other, never refused (what the caller knows, e.g. the workload)."""
    if not methods:
        raise ValueError(f"no method given; choose from {', '.join(METHODS)}.")
    for method in methods:
        _spec_class(method)
    given = {k: v for k, v in options.items() if v is not None}
    for key in given:
        if not any(key in options_of(m) for m in methods):
            takers = [m for m in METHODS if key in options_of(m)]
            raise ValueError(f"{(flags or {}).get(key, key)} is an option of {', '.join(takers)}; none of "
                             f"{', '.join(methods)} takes it.")  # fmt: skip
    given |= {k: v for k, v in (context or {}).items() if v is not None}
    return [parse(m, **{k: v for k, v in given.items() if k in options_of(m)}) for m in methods]


def drafts(method: str, tree) -> bool:
    """Whether ``method`` drafts ``tree`` (what :func:`parse_tree` reads)."""
    cls = _spec_class(method)
    return issubclass(cls, DraftedSpec) and cls.drafts_tree(parse_tree(tree))


def tuned_families(*, head=None, draft_model=None) -> list[str]:
    """The drafter families ``jspec tune`` measures with what it was given: those that need nothing, and
    those whose head (its own kind: a folder counts as EAGLE-3) or draft model is there."""
    given = {"head": head, "draft_model": draft_model}
    kind = getattr(getattr(head, "config", None), "kind", "eagle3")
    return [name for name, cls in _SPECS.items() if cls.tuned and issubclass(cls, DraftedSpec)
            and (cls.needs is None or given[cls.needs] is not None)
            and (cls.needs != "head" or name == kind)]  # fmt: skip


def needs_of(method: str) -> str | None:
    """The option the tuner cannot try ``method`` without (``head``, ``draft_model``), or None."""
    return _spec_class(method).needs


def label_of(method: str, num_draft: int | None = None, tree=None) -> str:
    """The short name profiles, tuned configs and results use: "ar", "ngram:N=3", "eagle3:tree=dynamic"."""
    if "num_draft" not in options_of(method):
        return method
    tree = tree_text(tree)
    return f"{method}:N={num_draft or DEFAULT_NUM_DRAFT}" if tree is None else f"{method}:tree={tree}"


def from_json(data) -> MethodSpec:
    """The spec :meth:`MethodSpec.to_json` wrote."""
    if not isinstance(data, dict) or not isinstance(data.get("method"), str):
        raise ValueError(f"a method spec is an object with a method name; got {data!r}.")
    return parse(data["method"], **{k: v for k, v in data.items() if k != "method"})


def make_drafter(method: str, target, *, model_name: str | None = None, lookahead: dict | None = None, **options):
    """The drafter for a method with its options (:func:`parse`), ready for :class:`jspec.SpeculativeDecoder`.

    ``model_name``: the target's registry name (finds the shipped head). ``lookahead``: Lookahead
    decoding's options as one dict (``window``, ``level``, ``guesses``, ``pool_size``, ``prompt_ngrams``).
    """
    return parse(method, **options, **(lookahead or {})).drafter(target, model_name=model_name)
