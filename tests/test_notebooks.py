"""The notebooks: executed by a real Jupyter kernel, and committed with current outputs and plots.

``make notebooks`` (``notebooks/execute.py``) executes them in place and stamps each code cell with
the SHA-256 of the source that produced its outputs; a notebook whose code changed since is stale.
"""

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


def test_five_notebooks_one_workflow_each():
    names = [p.stem for p in NOTEBOOKS]
    assert len(names) == 5, names
    for topic in ("exactness", "real_model", "trees", "training", "tuning"):
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
