"""What the experiment scripts share: timing in turns, medians, list arguments, plots, and one record
per run (the methods measured, the machine, the versions, the date, the command).

Decoders over prompts are timed by :func:`jspec.analysis.bench.run_interleaved`; anything smaller (a
forward, a training step, a kernel) by :func:`interleaved_seconds`, the same way: every candidate
compiled first and untimed, then the candidates taking turns so that drift in a shared machine's
speed hits all alike. Every script writes its results with :func:`save` (or :func:`append`, for a
file that collects runs), so that a result file says what produced it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata

import jax

from jspec.analysis.bench import turn_order
from jspec.cli.common import figure

__all__ = [
    "SCHEMA",
    "append",
    "arguments",
    "floats",
    "interleaved_seconds",
    "ints",
    "load_script",
    "machine",
    "median_ms",
    "medians_ms",
    "plot",
    "record",
    "runs",
    "save",
    "versions",
]

SCHEMA = "jspec.experiment/1"  # the "run" entry's layout; bump when a field changes meaning


def interleaved_seconds(fns: Mapping[str, Callable[[], object]], repeats: int, rotate: bool = True,
                        ) -> dict[str, list[float]]:  # fmt: skip
    """Seconds per call of each of ``fns``, taking turns: one untimed call each (the compilation),
    then ``repeats`` rounds in which every function runs once, each call waited for
    (``jax.block_until_ready`` on what it returns). With ``rotate`` the order changes from round to
    round (:func:`jspec.analysis.bench.turn_order`), so that each follows every other equally often."""
    if repeats < 1 or not fns:
        raise ValueError(f"need functions and repeats >= 1; got {len(fns)} functions, repeats {repeats}.")
    names = list(fns)
    for name in names:
        jax.block_until_ready(fns[name]())
    seconds = {name: [] for name in names}
    for i in range(repeats):
        for name in [names[j] for j in turn_order(len(names), i)] if rotate else names:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name]())
            seconds[name].append(time.perf_counter() - t0)
    return seconds


def medians_ms(fns: Mapping[str, Callable[[], object]], repeats: int = 10) -> dict[str, float]:
    """The median milliseconds per call of each of ``fns``, timed in turns (:func:`interleaved_seconds`)."""
    return {name: 1000 * statistics.median(s) for name, s in interleaved_seconds(fns, repeats).items()}


def median_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """The median milliseconds of ``fn()`` over ``repeats`` calls, after one untimed call (the compilation)."""
    return medians_ms({"fn": fn}, repeats)["fn"]


def ints(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (empty items skipped)."""
    return [int(x) for x in text.split(",") if x.strip()]


def floats(text: str) -> list[float]:
    """``"0,0.7,1"`` -> [0.0, 0.7, 1.0] (empty items skipped)."""
    return [float(x) for x in text.split(",") if x.strip()]


_COMMON = {  # the options most scripts take, as they all spell them
    "model": {"help": "a registry name (jspec models) or a Hugging Face folder"},
    "prompts": {"help": "prompt sets, comma-separated: mt-bench, humaneval, spec-bench[:CATEGORY] or a .jsonl"},
    "limit": {"type": int, "help": "prompts per set"},
    "max_new_tokens": {"type": int, "help": "new tokens per prompt"},
    "temperatures": {"help": "comma-separated, e.g. 0,1"},
    "repeats": {"type": int, "help": "timed repeats (their median is reported)"},
    "seed": {"type": int},
    "out": {"type": pathlib.Path, "help": "where the results go"},
}


def arguments(doc: str | None, **defaults) -> argparse.ArgumentParser:
    """An argument parser described by the script's docstring with the common options named in
    ``defaults`` (``model``, ``prompts``, ``limit``, ``max_new_tokens``, ``temperatures``, ``repeats``,
    ``seed``, ``out``), each with the script's default; the script adds its own."""
    unknown = sorted(set(defaults) - set(_COMMON))
    if unknown:
        raise TypeError(f"arguments() has no common option {', '.join(unknown)}; add it with add_argument.")
    out = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in defaults.items():
        kind = _COMMON[name].get("type", str)
        value = kind(default) if default is not None and kind is pathlib.Path else default
        out.add_argument("--" + name.replace("_", "-"), default=value, **_COMMON[name])
    return out


def machine() -> dict:
    """Where a run ran: the host's platform and CPUs, and JAX's backend and devices."""
    devices = jax.devices()
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "backend": jax.default_backend(),
            "device_kind": devices[0].device_kind, "device_count": len(devices)}  # fmt: skip


def versions() -> dict:
    """The versions a result depends on: Python, jax, jaxlib, flax, numpy, and jspec's commit where
    it runs from a git checkout (``+dirty`` with uncommitted changes; None elsewhere)."""
    out = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "flax", "numpy"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        top, commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
                                     capture_output=True, text=True, timeout=10, check=True).stdout.split()  # fmt: skip
        if pathlib.Path(top).resolve() != root:  # a copy without its .git inside someone else's repository
            raise subprocess.SubprocessError(top)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        out["jspec"] = commit + ("+dirty" if dirty else "")
    except (OSError, ValueError, subprocess.SubprocessError):
        out["jspec"] = None
    return out


def _spec_json(spec) -> dict | str:
    to_json = getattr(spec, "to_json", None)
    return to_json() if callable(to_json) else spec if isinstance(spec, dict) else str(spec)


def record(args=None, specs: Iterable = (), started: float | None = None) -> dict:
    """The record of this run, saved beside its results as ``"run"``: the layout (:data:`SCHEMA`), the
    command, its parsed arguments, the methods measured (a :class:`jspec.methods.MethodSpec` as its
    JSON, a label such as "ngram:N=3" as it is), the machine, the versions, the UTC date, and the
    seconds since ``started`` (a :func:`time.time`), when given."""
    now = time.time()
    out = {
        "schema": SCHEMA,
        "command": shlex.join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]),
        "args": {k: str(v) if isinstance(v, pathlib.PurePath) else v for k, v in vars(args).items()} if args else {},
        "specs": [_spec_json(s) for s in specs],
        "machine": machine(),
        "versions": versions(),
        "date": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(timespec="seconds"),
    }
    if started is not None:
        out["seconds"] = round(now - started, 1)
    return out


def _write(path: pathlib.Path, data) -> None:
    """Writes JSON whole or not at all: a killed run leaves the previous file, never half of one."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def save(path, report: dict, args=None, specs: Iterable = (), started: float | None = None) -> dict:
    """Writes ``report`` to ``path`` as JSON with this run's :func:`record` under ``"run"``; returns it so."""
    report = {**report, "run": record(args, specs, started)}
    _write(path, report)
    return report


def runs(path) -> list[dict]:
    """The runs a result file collects (:func:`append`); none where it is absent."""
    path = pathlib.Path(path)
    found = json.loads(path.read_text()) if path.exists() else []
    if not isinstance(found, list):
        raise ValueError(f"{path} holds a {type(found).__name__}, not a list of runs; name another file.")
    return found


def append(path, entry: dict, args=None, specs: Iterable = (), started: float | None = None,
           previous: list[dict] | None = None) -> list[dict]:  # fmt: skip
    """Writes the runs already in ``path`` (or ``previous``, read once by a run that saves as it goes)
    and ``entry`` with its :func:`record` after them; returns the list. For result files that collect
    runs across sessions and machines."""
    previous = runs(path) if previous is None else previous
    out = [*previous, {**entry, "run": record(args, specs, started)}]
    _write(path, out)
    return out


def load_script(path):
    """An experiment script (a ``.py`` file) as a module, without running its ``main``: how one script
    reuses another's measurement, and how the tests call scripts."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no experiment script at {path}.")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def plot(path, figsize: tuple[float, float] = (8, 4), dpi: int = 120):
    """A matplotlib figure, laid out and saved to ``path`` when the block ends; pyplot's backend is never
    touched, so a notebook's inline plots stay as they were."""

    fig = figure(figsize=figsize)
    yield fig
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
