"""The package as a wheel ships it: every package folder listed in pyproject.toml, and a top level that
reads as the architecture."""

import ast
import importlib.metadata
import os
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def unlisted_packages(listed: list[str], root: pathlib.Path = ROOT) -> list[str]:
    """Folders of jspec/ holding an ``__init__.py`` that pyproject's ``packages`` leaves out (a wheel
    built from the checkout would lack them; an editable install hides that)."""
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "jspec").rglob("__init__.py")}
    return sorted(found - set(listed))


def test_every_package_is_listed_for_the_wheel():
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert unlisted_packages(listed) == []
    assert "jspec.models" in listed  # models/, installed under jspec's name
    # Negative control: the list of before 2026-12-04 shipped a wheel without drafters, training or tune.
    assert unlisted_packages(["jspec", "jspec.models"])[:3] == ["jspec.analysis", "jspec.cli", "jspec.core"]


def test_the_top_level_is_at_most_twelve_entries():
    entries = sorted(p.name for p in (ROOT / "jspec").iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, entries


def unexplained_local_imports(source: str) -> list[int]:
    """Lines of imports inside a function with no reason given: a comment on the import's first line,
    on the line above it, or on the line above the run of imports it belongs to. A module imported
    inside a function is an optional dependency or a start-up cost, and says which."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for stmt in ast.walk(node):
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                first = stmt.lineno - 1
                while first > 0 and lines[first - 1].lstrip().startswith(("import ", "from ")):
                    first -= 1  # the run of imports this one belongs to
                near = [lines[stmt.lineno - 1], lines[stmt.lineno - 2], lines[first - 1] if first else ""]
                if not any("#" in line for line in near):
                    found.append(stmt.lineno)
    return sorted(found)


def test_every_import_inside_a_function_says_why_with_negative_control():
    found = {}
    for folder in ("jspec", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if lines := unexplained_local_imports(path.read_text()):
                found[str(path.relative_to(ROOT))] = lines
    assert found == {}
    bare = "def f():\n    import json\n\n    return json\n"
    assert unexplained_local_imports(bare) == [2]  # negative control: an import with no reason is found
    told = "def f():\n    # imported here: an optional extra\n    import a\n    import b\n\n    return a, b\n"
    assert unexplained_local_imports(told) == []


# `make demo` installs jspec without pyproject's extras (`make setup-run`), so jspec and models/ may
# import an extra's module only where a user asks for what needs it.
ALLOWED_EXTRAS = {
    ("jspec/training/conversations.py", "datasets"),  # a Hugging Face dataset folder as conversations
    ("models/torch_state.py", "torch"),  # .bin/.pt checkpoints
}


def extras_modules(root: pathlib.Path = ROOT) -> set[str]:
    """The top-level modules of every distribution named in pyproject's extras, from the installed
    metadata (``pytest-xdist`` provides ``xdist``), so an extra added to pyproject is checked too."""
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {_distribution_name(req) for reqs in extras.values() for req in reqs}
    provided = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provided.setdefault(_distribution_name(dist), set()).add(module)
    missing = sorted(wanted - provided.keys())
    assert not missing, f"extras not installed: {missing}; run `make setup`"
    return set().union(*(provided[name] for name in wanted))


def _distribution_name(requirement: str) -> str:
    """``pytest-xdist>=3.6`` -> ``pytest-xdist``: the name, normalized as PEP 503 does."""
    name = re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def imports_of_extras(source: str, extras: set[str]) -> set[str]:
    """The extras' modules a source imports anywhere (at its top or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & extras


def test_an_extra_added_to_pyproject_is_mapped_to_its_modules(tmp_path):
    extras = '[project.optional-dependencies]\nx = ["pytest-xdist>=3.6", "Hypothesis"]\n'
    (tmp_path / "pyproject.toml").write_text(extras)
    assert {"xdist", "hypothesis"} <= extras_modules(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project.optional-dependencies]\nx = ["no-such-dist>=1"]\n')
    with pytest.raises(AssertionError, match="no-such-dist"):
        extras_modules(tmp_path)


def test_the_library_imports_the_extras_only_where_a_user_asks_for_them():
    extras = extras_modules()
    assert {"pytest", "xdist", "torch", "transformers", "datasets", "ruff"} <= extras
    found = set()
    for folder in ("jspec", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found |= {(str(path.relative_to(ROOT)), m) for m in imports_of_extras(path.read_text(), extras)}
    assert found == ALLOWED_EXTRAS
    # Negative control: an import of transformers, at the top or in a function, is found.
    assert imports_of_extras("import numpy\nfrom transformers.models import llama\n", extras) == {"transformers"}
    assert imports_of_extras("def f():\n    import torch.nn as nn  # an extra\n", extras) == {"torch"}


def test_make_demo_installs_jspec_without_the_extras():
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo: setup-run\n" in makefile
    run_recipe = makefile.split("$(RUN_STAMP): pyproject.toml\n")[1].split("\n\n")[0]
    assert "pip install --quiet -e .\n" in run_recipe and "[" not in run_recipe  # no extras


def test_jspec_and_its_models_from_two_checkouts_are_refused(tmp_path):
    """Another clone's jspec on PYTHONPATH, with this checkout installed in editable mode, would import this
    checkout's models beside the clone's code: refused, naming both and what to do."""
    import shutil
    import subprocess
    import sys

    import jspec.models
    from jspec.models import other_checkout

    models = pathlib.Path(jspec.models.__file__).resolve().parent
    if models != ROOT / "models":
        pytest.skip("jspec.models is not this checkout's models/ (not an editable install of it)")
    assert other_checkout(models, ROOT / "jspec" / "__init__.py") is None  # one checkout
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "jspec", clone / "jspec", ignore=shutil.ignore_patterns("__pycache__"))
    message = other_checkout(models, clone / "jspec" / "__init__.py")
    assert str(clone / "jspec") in message and str(models) in message and "off sys.path" in message
    (clone / "pyproject.toml").write_text("")  # a checkout: its own environment, or install it here
    message = other_checkout(models, clone / "jspec" / "__init__.py")
    assert f"pip install -e {clone}" in message and str(clone / ".venv") in message
    wheel = tmp_path / "site-packages" / "jspec"  # a wheel's models live in its jspec/, beside no pyproject
    (wheel / "models").mkdir(parents=True)
    assert other_checkout(wheel / "models", clone / "jspec" / "__init__.py") is None

    proc = subprocess.run([sys.executable, "-c", "import jspec"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(clone)})  # fmt: skip
    assert proc.returncode != 0 and "two versions of jspec would run together" in proc.stderr, proc.stderr[-2000:]
