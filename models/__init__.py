"""Target model families, weight loaders, the model registry and trained draft heads.

Installed as ``jspec.models`` (see pyproject.toml), so it never shadows another
project's top-level ``models`` package.
"""

import pathlib
import sys


def other_checkout(models_dir, jspec_file) -> str | None:
    """Why ``jspec`` and ``jspec.models`` come from two checkouts, or None.

    An editable install maps ``jspec.models`` to its own checkout's ``models/`` whatever ``sys.path``
    holds, so another clone's ``jspec`` on the path (``PYTHONPATH``, the working directory) would run
    with the installed clone's models: two versions of the code in one process, and nothing would say so.
    An installed wheel keeps the models inside its ``jspec/`` and is never refused.
    """
    root = pathlib.Path(models_dir).resolve().parent
    if not ((root / "pyproject.toml").is_file() and (root / "jspec" / "__init__.py").is_file()):
        return None  # not a checkout's models/: a wheel's jspec/models
    package = pathlib.Path(jspec_file).resolve().parent
    if package == root / "jspec":
        return None
    other = package.parent
    if (other / "pyproject.toml").is_file():
        fix = (f"Run with that checkout's environment (`make setup` there makes {other / '.venv'}), or install it "
               f"into this one (`pip install -e {other}`).")  # fmt: skip
    else:
        fix = f"Take {other} off sys.path (PYTHONPATH, the working directory) to run the installed checkout."
    return (f"jspec is imported from {package}, but jspec.models from {root / 'models'} (the checkout installed "
            f"in this environment): two versions of jspec would run together. {fix}")  # fmt: skip


_jspec = sys.modules.get("jspec") if __name__ == "jspec.models" else None
_problem = None if _jspec is None else other_checkout(pathlib.Path(__file__).parent, _jspec.__file__)
if _problem:
    raise ImportError(_problem)
