"""The package as a wheel ships it: every package folder listed in pyproject.toml, and a top level that
reads as the architecture."""

import pathlib
import tomllib

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
