"""Method specs (jspec.methods): parsing, refusals by name, the JSON round trip, a new drafter in one
spec, and no import circle in the package."""

import ast
import dataclasses
import pathlib
from typing import ClassVar

import pytest

import jspec
from jspec import methods
from jspec.core.tree import DynamicTreeSpec, StaticTree
from jspec.drafters import PromptLookup
from jspec.models.tiny import tiny_model
from jspec.tune.tuned import Setting


@pytest.mark.parametrize(
    "spec",
    [
        methods.parse("ar"),
        methods.parse("ngram", num_draft=6, ngram_min=1),
        methods.parse("ngram", tree="3,1,1"),
        methods.parse("draft", draft_model="qwen2.5-coder-0.5b", tree=[2, 2]),
        methods.parse("eagle3", head="ORG/NAME@v1", tree="dynamic"),
        methods.parse("eagle3", tree=DynamicTreeSpec(2, 4, 9)),
        methods.parse("eagle1", num_draft=2),
        methods.parse("medusa", head="heads", tree="measured:total=12"),
        methods.parse("lookahead", window=3, level=4, guesses=5, prompt_ngrams=False),
        methods.parse("auto", config="tuned.json", workload="humaneval"),
    ],
    ids=lambda s: s.label,
)
def test_a_spec_round_trips_through_json(spec):
    data = spec.to_json()
    back = methods.from_json(data)
    assert back.to_json() == data and type(back) is type(spec)
    tree = getattr(spec, "tree", None)
    assert methods.parse_tree(getattr(back, "tree", None)) == methods.parse_tree(tree)
    if not isinstance(tree, DynamicTreeSpec):  # a tree object comes back as its text
        assert back == spec


def test_unknown_methods_and_options_are_refused_by_name_before_anything_loads():
    with pytest.raises(ValueError, match="unknown method 'eagle9'; choose from ar, ngram"):
        methods.parse("eagle9")
    with pytest.raises(ValueError, match="method 'ngram' takes num_draft, tree, ngram_min, ngram_max; not head"):
        methods.parse("ngram", head="x")
    with pytest.raises(ValueError, match="method 'ar' takes no options; not num_draft"):
        methods.parse("ar", num_draft=3)
    with pytest.raises(ValueError, match="--head is an option of eagle3, eagle1, medusa, auto; none of ar, ngram"):
        methods.parse_all(["ar", "ngram"], flags={"head": "--head"}, head="x")
    specs = methods.parse_all(["ar", "ngram", "auto"], context={"workload": "mt-bench"}, num_draft=3)
    assert [s.label for s in specs] == ["ar", "ngram:N=3", "auto"] and specs[2].workload == "mt-bench"
    with pytest.raises(ValueError, match="draft_model is a loaded Transformer; a spec saved as JSON names it"):
        methods.parse("draft", draft_model=tiny_model("qwen2", seed=0, num_layers=1)).to_json()
    with pytest.raises(ValueError, match="lookahead level"):
        methods.parse("lookahead", level=1)  # LookaheadDecoding's own check, at parse time


def test_tuned_settings_are_named_and_built_as_their_specs():
    for setting in (Setting("ar"), Setting("ngram", num_draft=3), Setting("eagle3", tree="dynamic")):
        spec = methods.parse(setting.method, num_draft=setting.num_draft, tree=setting.tree)
        assert setting.shape == spec.label
    target = tiny_model("qwen2", seed=0, num_layers=1)
    decoder = Setting("ngram", num_draft=3, adaptive=True, costs=(2.0, 1.0)).decoder(target, head="ignored")
    assert decoder.drafter == PromptLookup(num_draft=3) and decoder.adaptive is not None


@dataclasses.dataclass(frozen=True)
class EveryOtherSpec(methods.DraftedSpec):
    """A toy method: prompt lookup drafting one token fewer than asked (a new drafter class would sit in
    its own file under jspec/drafters; the spec is the only other thing a new method needs)."""

    name: ClassVar[str] = "every-other"
    trees: ClassVar = (StaticTree,)

    def drafter(self, target, *, model_name=None):
        return PromptLookup(num_draft=max(1, (self.num_draft or 4) - 1))


def test_a_new_drafter_is_its_file_and_its_spec(monkeypatch):
    """Registering the spec is all jspec.make_decoder, Speculator and the JSON round trip need."""
    monkeypatch.setattr(methods, "_SPECS", dict(methods._SPECS))  # the registry as it was, after the test
    assert methods.register(EveryOtherSpec) is EveryOtherSpec
    with pytest.raises(ValueError, match="method 'every-other' exists already"):
        methods.register(EveryOtherSpec)
    target = tiny_model("qwen2", seed=0, num_layers=1)
    decoder = jspec.make_decoder("every-other", target, num_draft=3)
    assert decoder.drafter.num_draft == 2
    assert methods.from_json({"method": "every-other", "num_draft": 5}) == EveryOtherSpec(num_draft=5)
    with pytest.raises(ValueError, match="method 'every-other' drafts chains or static or dynamic trees"):
        methods.parse("every-other", tree="dynamic")


def _import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file (module level or in a function)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in names.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            edges |= {t for t in targets if t in names and t != module and t.startswith(package)}
        graph[module] = edges
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules around it, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return [*stack[stack.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_package_has_no_import_circle_with_negative_control():
    """Every import counts, a function's too (that only hides a circle); a package's __init__ importing
    its own modules is the package, not an edge back."""
    root = pathlib.Path(jspec.__file__).parent
    graph = _import_graph(root, "jspec")
    for module in graph:  # `import jspec.x` from inside jspec reaches the package __init__ first: not a circle
        graph[module] = {n for n in graph[module] if not module.startswith(n + ".")}
    assert _circle(graph) is None, " -> ".join(_circle(graph))
    broken = {m: set(e) for m, e in graph.items()}
    broken["jspec.methods"].add("jspec.api")  # api -> methods already: the circle the test must see
    assert _circle(broken) is not None


def _method_name_comparisons(source: str) -> list[int]:
    """Lines comparing a method or family variable with a method's name (``method == "ngram"``,
    ``"draft" in methods``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Constant) and s.value in methods.METHODS for s in sides)
            words = [getattr(s, "id", None) or getattr(s, "attr", "") for s in sides]
            if named and any(w and ("method" in w or "family" in w) for w in words):
                lines.append(node.lineno)
    return lines


def test_only_jspec_methods_compares_method_names_with_negative_control():
    root = pathlib.Path(jspec.__file__).parent
    found = {str(p.relative_to(root)): _method_name_comparisons(p.read_text()) for p in root.rglob("*.py")}
    assert {k: v for k, v in found.items() if v and k != "methods.py"} == {}
    assert _method_name_comparisons('if setting.method == "ngram":\n    pass\nok = "draft" in methods\n') == [1, 3]


def test_the_tuner_tries_the_families_it_has_what_for():
    assert methods.tuned_families() == ["ngram"]
    assert methods.tuned_families(head="folder", draft_model="m") == ["ngram", "draft", "eagle3"]
    assert methods.drafts("eagle3", "dynamic") and methods.drafts("ngram", "3,1,1") and methods.drafts("draft", "2,2")
    assert not methods.drafts("ngram", "dynamic") and not methods.drafts("draft", "dynamic")
    assert not methods.drafts("ar", "2,2")
