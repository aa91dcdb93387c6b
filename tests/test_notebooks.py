"""Every notebook's code runs top to bottom against the installed jspec."""

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch, capsys):
    nb = json.loads(path.read_text())
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"), "clear outputs"
    monkeypatch.chdir(path.parent)
    source = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    exec(compile(source, str(path), "exec"), {"__name__": "__main__"})
