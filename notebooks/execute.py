"""Executes the notebooks in place with a real Jupyter kernel and stamps what produced their outputs.

    python notebooks/execute.py [NAME.ipynb ...]      (``make notebooks`` runs it on all of them)

Each code cell's metadata records the SHA-256 of the source that produced its outputs
(``jspec.source_sha256``), so the tests can tell a notebook whose code changed after its outputs
were made (stale) from a current one; the notebook's metadata records how long it ran and where.
"""

from __future__ import annotations

import hashlib
import pathlib
import platform
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
STAMP = "jspec"


def source_sha256(cell) -> str:
    return hashlib.sha256(cell["source"].encode()).hexdigest()


def execute(path: pathlib.Path, *, timeout: int = 1200, write: bool = True, env: dict | None = None):
    """Runs ``path`` top to bottom in a fresh kernel (working directory: the notebooks folder; ``env``:
    the kernel's environment, default this process's); returns the executed notebook and its wall time.
    Raises ``nbclient.exceptions.CellExecutionError`` on an error."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}})
    client.execute(**({} if env is None else {"env": env}))
    seconds = time.perf_counter() - t0
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.metadata.pop("execution", None)  # timestamps: noise in every diff
            cell.metadata[STAMP] = {"source_sha256": source_sha256(cell)}
    nb.metadata[STAMP] = {
        "seconds": round(seconds, 1),
        "machine": f"{platform.machine()}, {platform.system()}, Python {platform.python_version()}",
    }
    if write:
        nbformat.write(nb, path)
    return nb, seconds


def main(argv: list[str]) -> int:
    paths = [HERE / a for a in argv] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        _, seconds = execute(path)
        print(f"{path.name}: executed in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
