"""Prompts from Hugging Face datasets (``train_dataset.hf``, split, column renames) and math answers
checked with math-verify (``trellis.engine.rollout.rewards:math_verify``); and the GSM8K-format example
run from a user's own folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from trellis.engine.config import DatasetConfig
from trellis.engine.data.prompts import DatasetError, load_prompts

datasets = pytest.importorskip("datasets")
pytest.importorskip("math_verify")
from trellis.engine.rollout.rewards import math_verify  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GSM8K_ROWS = [
    {"question": "Ann has 3 pens and gets 4 more. How many pens?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "Bo has 1,000 cups and sells 1 cup. How many cups?", "answer": "1000 - 1 = 999\n#### 999"},
]


@pytest.mark.parametrize(("label", "response", "score"), [
    ("3 + 4 = 7\n#### 7", "7", 1.0),
    ("3 + 4 = 7\n#### 7", "3 and 4 make 7. #### 7", 1.0),
    ("3 + 4 = 7\n#### 7", "I think 8", 0.0),
    ("#### 1000", "It is 1,000.", 1.0),
    ("\\frac{1}{2}", "The answer is \\boxed{0.5}", 1.0),
    ("\\frac{1}{2}", "The answer is \\boxed{\\frac{2}{3}}", 0.0),
    ("#### 7", "no number here", 0.0),
])
def test_math_verify_reads_gsm8k_labels_and_compares_by_value(label, response, score):
    assert math_verify({"label": label, "response": response})["score"] == score


def test_math_verify_refuses_a_label_without_an_answer():
    """Tried: a label with no number or expression in it. A reward error (the sample FAILED), not a 0."""
    with pytest.raises(ValueError, match="no answer could be read from the label"):
        math_verify({"label": "see the book", "response": "7"})


def _tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_an_hf_dataset_folder_is_read_by_split_with_renamed_columns(tmp_path, tiny_model):
    folder = tmp_path / "gsm8k"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_ROWS), "test": datasets.Dataset.from_list(GSM8K_ROWS[:1])}).save_to_disk(folder)
    config = DatasetConfig(hf=str(folder), split="test", columns={"question": "prompt", "answer": "label"})
    records, report = load_prompts(config, _tokenizer(tiny_model))
    assert [(r.messages[0]["content"], r.label) for r in records] == [(GSM8K_ROWS[0]["question"], GSM8K_ROWS[0]["answer"])]
    assert report.rows_read == 1 and config.source == f"hf:{folder}[test]"

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    records, _ = load_prompts(DatasetConfig(hf=str(jsonl), columns={"question": "prompt", "answer": "label"}), _tokenizer(tiny_model))
    assert [r.label for r in records] == [row["answer"] for row in GSM8K_ROWS]


def test_column_renames_apply_to_parquet_files_too(tmp_path, tiny_model):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), path)
    records, _ = load_prompts(DatasetConfig(path=str(path), columns={"question": "prompt", "answer": "label"}), _tokenizer(tiny_model))
    assert [r.label for r in records] == [row["answer"] for row in GSM8K_ROWS]


def test_hf_dataset_mistakes_are_named(tmp_path, tiny_model):
    """Tried: a split the dataset lacks, a column rename naming no column, a name that is neither a local
    folder nor on a hub (none is reachable here), and both path and hf set."""
    folder = tmp_path / "gsm8k"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_ROWS)}).save_to_disk(folder)
    tokenizer = _tokenizer(tiny_model)
    with pytest.raises(DatasetError, match="no split 'validation'; it has train"):
        load_prompts(DatasetConfig(hf=str(folder), split="validation", prompt_key="question"), tokenizer)
    with pytest.raises(DatasetError, match=re.escape("columns names ['problem'], not among the dataset's columns ['answer', 'question']")):
        load_prompts(DatasetConfig(hf=str(folder), columns={"problem": "prompt"}), tokenizer)
    with pytest.raises(DatasetError, match="not a local folder or file, and the hub did not give it"):
        load_prompts(DatasetConfig(hf="nobody-here/no-such-dataset", prompt_key="question"), tokenizer)
    with pytest.raises(ValueError, match="set exactly one of path"):
        DatasetConfig(hf=str(folder), path=str(folder))


@pytest.mark.slow
def test_a_users_gsm8k_style_task_trains_from_its_own_folder_with_math_verify(tmp_path):
    """examples/gsm8k_style copied to a folder of the user's, prepared there, trained from there: the
    prompts come from its datasets folder, and every sample's reward is math-verify's verdict on it."""
    project = tmp_path / "my-math"
    shutil.copytree(ROOT / "examples" / "gsm8k_style", project, ignore=shutil.ignore_patterns("model", "data", "runs"))
    env = {**os.environ, "PYTHONPATH": str(project), "HF_DATASETS_OFFLINE": "1"}
    prepared = subprocess.run([sys.executable, "prepare.py"], cwd=project, capture_output=True, text=True, timeout=300, env=env)
    assert prepared.returncode == 0, prepared.stderr
    trellis = str(Path(sys.executable).with_name("trellis"))
    trained = subprocess.run(
        [trellis, "train", "math.yaml", "--in-process", "--set", "total_train_steps=2", "--set", "enable_initial_evaluate=false",
         "--set", "evaluate_step=2"],
        cwd=project, capture_output=True, text=True, timeout=600, env=env,
    )
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]

    questions = {row["question"]: row["answer"] for row in datasets.load_from_disk(project / "data")["train"]}
    rows = pq.read_table(project / "runs" / "gsm8k_style" / "trajectories" / "split=train").to_pylist()
    assert len(rows) == 2 * 16 * 8
    for row in rows:
        [message] = eval(row["prompt"]) if isinstance(row["prompt"], str) else row["prompt"]
        assert questions[message["content"]] == row["label"]
        numbers = re.findall(r"\d+", row["response"])
        right = bool(numbers) and int(numbers[-1]) == int(row["label"].rsplit("#### ", 1)[1])
        assert row["reward"] == (1.0 if right else 0.0), row
    assert 0 < sum(row["reward"] for row in rows) < len(rows)  # the warmed-up model is right sometimes, not always
    metrics = [json.loads(line) for line in (project / "runs" / "gsm8k_style" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert "eval/accuracy" in metrics[-1]
