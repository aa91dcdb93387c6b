"""Evaluation prompt sets load from where they live, with clear errors."""

import json

import pytest

from jspec.analysis.prompts import SPEC_BENCH_DEFAULT, load_prompts


def test_spec_bench_style_file(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [
        {"question_id": i, "category": "qa" if i % 2 else "math", "turns": [f"q{i}", "follow-up"]} for i in range(5)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    prompts = load_prompts(str(path), category="qa", limit=1)
    assert [(p.id, p.category, p.text) for p in prompts] == [("1", "qa", "q1")]
    with pytest.raises(ValueError, match="categories here: math, qa"):
        load_prompts(str(path), category="poetry")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no file at"):
        load_prompts(str(tmp_path / "nope.jsonl"))


@pytest.mark.skipif(not SPEC_BENCH_DEFAULT.exists(), reason="Spec-Bench is not beside the project")
def test_spec_bench_default():
    prompts = load_prompts("spec-bench")
    assert len(prompts) == 480 and {"translation", "summarization", "rag"} <= {p.category for p in prompts}


def test_mt_bench_and_humaneval_from_their_wheels():
    assert len(load_prompts("mt-bench")) == 80
    humaneval = load_prompts("humaneval", limit=2)
    assert humaneval[0].id == "HumanEval/0" and "def " in humaneval[0].text
