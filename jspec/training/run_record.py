"""The record of a training run kept beside its checkpoints, so that a resumed run is the same run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import sys

import numpy as np

from jspec.files import write_text

__all__ = ["check_same_run"]


def check_same_run(folder: pathlib.Path, recipe, data: dict, model_name: str) -> None:
    """Records what a run trains (the recipe but its checkpoint interval, the model, a hash of the token ids
    and masks) beside its checkpoints, and refuses to resume checkpoints a different run wrote: resuming
    them on other data or options would mix two runs into one head. Nothing is overwritten."""
    digest = hashlib.sha256()
    for key in ("tokens", "mask"):
        digest.update(np.ascontiguousarray(data[key]).tobytes())
    train = {k: v for k, v in dataclasses.asdict(recipe.train).items() if k != "checkpoint_every"}
    record = {"model": model_name, "data_sha256": digest.hexdigest(), "examples": len(data["tokens"]),
              "recipe": json.loads(json.dumps(dataclasses.asdict(recipe) | {"train": train}))}  # fmt: skip
    for key in ("gen_batch",):  # how the data was batched while made, not what it is
        record["recipe"].pop(key)
    path = folder / "run.json"
    if path.exists():
        had = json.loads(path.read_text())
        added = {"datasets": []}  # recipe fields added since runs were first recorded, at their defaults
        had["recipe"] = {k: v for k, v in added.items() if k in record["recipe"]} | had.get("recipe", {})
        if had != record:
            diff = [k for k in ("model", "data_sha256", "examples") if had.get(k) != record[k]]
            diff += [f"recipe.{k}" for k in record["recipe"] if had.get("recipe", {}).get(k) != record["recipe"][k]]
            raise ValueError(
                f"{folder} holds checkpoints of another run (differs in {', '.join(diff)}); resuming them would "
                "mix two runs. Train into another --out, or delete that folder to start this run there."
            )
    else:
        if any(folder.glob("[0-9]*")):  # written before runs were recorded: resumed as before, recorded now
            print(f"{folder} holds checkpoints without a record of their run; resuming them as this run's",
                  file=sys.stderr)  # fmt: skip
        write_text(path, json.dumps(record, indent=1))
