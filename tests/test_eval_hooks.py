"""Evaluation as the user shapes it: their own metric function (``eval_metric``), the reward above which
a sample counts as correct, and a seeded random share of the evaluation set (``sample_ratio``) instead
of only its first rows. Tried: a metric that raises, and one that returns a non-number, lose nothing
but their own figures."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from trellis.engine.config import DatasetConfig
from trellis.engine.data.prompts import load_prompts
from trellis.engine.run.local import LocalRun
from helpers import lake_rows, tiny_config

METRICS = '''
def share_long(groups):
    """The share of evaluation samples whose response has more than 3 characters, and how many groups."""
    samples = [sample for group in groups for sample in group]
    return {"long_share": sum(len(s["response"]) > 3 for s in samples) / len(samples), "groups": len(groups)}

def broken(groups):
    raise RuntimeError("the metric's own bug")

def not_numbers(groups):
    return {"label": "text", "fine": 1}
'''


def logged(config) -> dict[int, dict]:
    lines = (Path(config.run_uri) / "logs" / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def test_a_users_eval_metric_and_correctness_threshold_reach_the_eval_metrics(tiny_model, reverse_data, tmp_path, caplog):
    (tmp_path / "my_metrics.py").write_text(METRICS)
    config = tiny_config(tiny_model, reverse_data, tmp_path / "run", total_train_steps=1, checkpoint_interval=-1, enable_evaluate=False,
                         enable_initial_evaluate=True, eval_metric=f"{tmp_path}/my_metrics.py:share_long", eval_correct_threshold=1.5)
    with LocalRun(config) as run:
        run.run()
    evaluation, rows = logged(config)[0], lake_rows(config, "eval")
    assert evaluation["eval/groups"] == 32.0 == len(rows)
    assert evaluation["eval/long_share"] == sum(len(row["response"]) > 3 for row in rows) / len(rows)
    assert evaluation["eval/accuracy"] == 0.0 and max(row["reward"] for row in rows) == 1.0  # no reward is above 1.5

    for name, says in (("broken", "RuntimeError: the metric's own bug"), ("not_numbers", "'label' is 'text', not a finite number")):
        other = tiny_config(tiny_model, reverse_data, tmp_path / name, total_train_steps=1, checkpoint_interval=-1, enable_evaluate=False,
                            enable_initial_evaluate=True, eval_metric=f"{tmp_path}/my_metrics.py:{name}")
        with LocalRun(other) as run:
            run.run()
        assert "eval/accuracy" in logged(other)[0] and says in caplog.text
    assert logged(other)[0]["eval/fine"] == 1.0


def test_an_eval_set_sampled_by_ratio_is_a_seeded_spread_subset(tiny_model, reverse_data):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base = dict(path=str(reverse_data["eval"]), max_prompt_length=64)
    every, _ = load_prompts(DatasetConfig(**base), tokenizer)
    first, _ = load_prompts(DatasetConfig(**base, sample_ratio=0.1), tokenizer)
    again, _ = load_prompts(DatasetConfig(**base, sample_ratio=0.1), tokenizer)
    other, _ = load_prompts(DatasetConfig(**base, sample_ratio=0.1, sample_seed=1), tokenizer)
    limited, _ = load_prompts(DatasetConfig(**base, sample_ratio=0.1, limit=8), tokenizer)
    indices = [record.index for record in first]
    assert len(first) == round(len(every) * 0.1) and indices == sorted(indices)
    assert indices == [record.index for record in again] != [record.index for record in other]
    assert max(indices) > len(every) // 2  # drawn across the set, not its first rows
    assert [record.index for record in limited] == indices[:8]
