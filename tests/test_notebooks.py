"""The notebooks: executed by a real Jupyter kernel, and committed with current outputs and plots.

``make notebooks`` (``notebooks/execute.py``) executes them in place and stamps each code cell with
the SHA-256 of the source that produced its outputs; a notebook whose code changed since is stale.

``make test`` checks that every committed notebook is current and its use of jspec against the
library (each name it imports or reaches through ``jspec.`` exists); the notebooks run in a kernel
in ``make test-slow`` and ``make notebooks`` (24 s for the first, 1.5-2 minutes each for the others).
"""

import ast
import importlib
import json
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _load_runner():
    import importlib.util

    spec = importlib.util.spec_from_file_location("nb_execute", ROOT / "notebooks" / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stale_cells(nb: dict) -> list[int]:
    """Indices of code cells whose outputs were not made by their current source (or were never made)."""
    runner = _load_runner()
    return [
        i
        for i, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "code"
        and cell.get("metadata", {}).get(runner.STAMP, {}).get("source_sha256")
        != runner.source_sha256({"source": "".join(cell["source"])})
    ]


def test_six_notebooks_one_workflow_each():
    names = [p.stem for p in NOTEBOOKS]
    assert len(names) == 6, names
    for topic in ("exactness", "real_model", "trees", "training", "tuning", "published_head"):
        assert any(topic in n for n in names), topic


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_current_with_outputs_and_plots(path):
    """What GitHub and Colab show: every code cell run by its current source, no errors, at least one plot,
    cells with ids, the install cell first and a stated runtime."""
    nb = json.loads(path.read_text())
    stale = stale_cells(nb)
    assert not stale, f"{path.name} is stale (code cells {stale} changed since their outputs): run `make notebooks`"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c.get("id") for c in nb["cells"]), f"{path.name}: cells without ids"
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o["output_type"] == "error"], f"{path.name} has an error output"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} has no plot"
    assert all(c.get("execution_count") for c in code), f"{path.name} has cells that were never run"
    assert "find_spec" in "".join(code[0]["source"]), f"{path.name}: the first code cell must install jspec"
    assert "**Runtime:**" in "".join(nb["cells"][0]["source"]), f"{path.name}: say its runtime and time"


def test_a_changed_cell_is_reported_stale():
    """Negative control of the staleness check."""
    nb = json.loads(NOTEBOOKS[0].read_text())
    first = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code")
    nb["cells"][first]["source"] = "".join(nb["cells"][first]["source"]) + "\nprint('edited')"
    assert stale_cells(nb) == [first]


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """The kernels' environment: JAX's persistent compilation cache in a folder of this test run, so the
    notebooks share what they compile alike (SmolLM2's loops) and no run depends on what an earlier one left."""
    import os

    cache = tmp_path_factory.mktemp("xla")
    return os.environ | {"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1"}


def jspec_names_missing(source: str) -> list[str]:
    """The jspec names a notebook's code uses that the library does not have (shell and magic lines skipped)."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("!", "%")))
    missing = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jspec":
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{a.name}" for a in node.names if not _resolves(module, a.name)]
        elif isinstance(node, ast.Attribute):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.insert(0, node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id == "jspec":
                obj, path = importlib.import_module("jspec"), "jspec"
                for attr in chain:
                    path += "." + attr
                    if not _resolves(obj, attr):
                        missing.append(path)
                        break
                    obj = _resolves(obj, attr)
    return missing


def _resolves(obj, attr):
    """``obj.attr``, importing a submodule where that is what the name is; None when there is none."""
    if hasattr(obj, attr):
        return getattr(obj, attr)
    if hasattr(obj, "__path__"):
        try:
            return importlib.import_module(f"{obj.__name__}.{attr}")
        except ModuleNotFoundError:
            return None
    return None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_jspec_name_a_notebook_uses_exists(path):
    """The quick guard for the notebooks that only `make test-slow` executes: a renamed or removed API fails here."""
    nb = json.loads(path.read_text())
    source = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert not jspec_names_missing(source), f"{path.name} uses names jspec lacks: {jspec_names_missing(source)}"


def test_a_missing_name_is_reported():
    """Negative control of the name check."""
    assert jspec_names_missing(
        "from jspec.analysis.bench import run_interleaved, no_such_thing\njspec.analysis.trace.nope(1)"
    ) == [
        "jspec.analysis.bench.no_such_thing",
        "jspec.analysis.trace.nope",
    ]
    assert jspec_names_missing("import jspec\n!pip -q install x\njspec.analysis.bench.run_interleaved") == []


@pytest.mark.slow  # 24 s for the first, 1.5-2 minutes for the others; make notebooks runs them all
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_a_jupyter_kernel(path, tmp_path, kernel_env):
    """Top to bottom in a fresh kernel (nbclient), as `make notebooks` runs it; the copy is thrown away."""
    runner = _load_runner()
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    nb, seconds = runner.execute(copy, write=False, env=kernel_env)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    print(f"{path.name}: {seconds:.0f} s")
