"""Loads a script of experiments/ (found by name in its purpose folders) as a module, so that tests call
its main() and helpers."""

import pathlib

from jspec.analysis.harness import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_experiment(name: str):
    found = sorted((ROOT / "experiments").glob(f"*/{name}.py")) or sorted((ROOT / "experiments").glob(f"{name}.py"))
    if len(found) != 1:
        raise FileNotFoundError(f"experiments/ holds {len(found)} scripts named {name}.py; expected one.")
    return load_script(found[0])
