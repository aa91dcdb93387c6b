"""Loads a script of experiments/ as a module, so that tests call its main() and helpers."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT / "experiments") not in sys.path:  # scripts import their shared harness as a sibling
    sys.path.insert(0, str(ROOT / "experiments"))


def load_experiment(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
