"""Datasets as a new user brings them: Parquet or JSONL, strings or chat messages, broken rows."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from trellis.engine.config import DatasetConfig
from trellis.engine.data.prompts import DatasetError, load_prompts


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_broken_jsonl_rows_are_skipped_counted_and_reported(tmp_path, tokenizer, caplog):
    lines = [
        json.dumps({"prompt": "reverse ABC", "label": "CBA", "difficulty": 1}),
        "{not json",
        json.dumps({"label": "no prompt here"}),
        json.dumps({"prompt": 42, "label": "x"}),
        json.dumps({"prompt": "reverse " + "A" * 400, "label": "x"}),
        json.dumps(["a", "list"]),
        json.dumps({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse XY"}], "label": "YX"}),
        json.dumps({"prompt": [{"role": "wizard", "content": "hi"}]}),
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records, report = load_prompts(DatasetConfig(path=str(path), max_prompt_length=64), tokenizer)

    assert [r.label for r in records] == ["CBA", "YX"]
    assert records[0].extra == {"difficulty": 1}
    assert records[1].messages[0] == {"role": "system", "content": "Be brief."}
    assert report.rows_read == 8 and report.rows_used == 2
    assert dict(report.skipped) == {
        "invalid JSON": 1,
        "no prompt": 1,
        "prompt of wrong type": 2,
        "prompt too long": 1,
        "not an object": 1,
    }
    assert "prompt too long" in caplog.text  # reported, not silently dropped


def test_parquet_folder_with_custom_keys(tmp_path, tokenizer):
    folder = tmp_path / "ds"
    folder.mkdir()
    for part in range(2):
        rows = [{"question": f"reverse AB{part}", "answer": "x", "source": "s"}]
        pq.write_table(pa.Table.from_pylist(rows), folder / f"part-{part}.parquet")
    config = DatasetConfig(path=str(folder), prompt_key="question", label_key="answer", data_source_key="source")
    records, _ = load_prompts(config, tokenizer)
    assert len(records) == 2 and records[0].data_source == "s"
    # Each prompt's whole ids, against the chat text written out by hand and tokenized plainly (not
    # through the chat template the loader uses). Tried: the loader dropping the prompt's last
    # character fails it, where comparing the ids' last 3 tokens (the template's suffix) passed.
    for part, record in enumerate(records):
        text = f"<|im_start|>user\nreverse AB{part}<|im_end|>\n<|im_start|>assistant\n"
        assert list(record.messages) == [{"role": "user", "content": f"reverse AB{part}"}]
        assert list(record.prompt_ids) == tokenizer(text, add_special_tokens=False)["input_ids"], part
    assert records[0].prompt_ids != records[1].prompt_ids


def test_missing_path_and_unusable_dataset_are_clear_errors(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(DatasetConfig(path=str(tmp_path / "nope.parquet")), tokenizer)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"label": 1}) + "\n")
    with pytest.raises(DatasetError, match="no usable rows: 1 rows read, 0 usable, skipped: 1 no prompt"):
        load_prompts(DatasetConfig(path=str(empty)), tokenizer)


def test_a_row_may_cap_its_own_response_length(tmp_path, tokenizer):
    """Tried: a positive cap, none, zero, a string and a boolean; the last three are skipped by reason."""
    caps = [5, None, 0, "10", True]
    path = tmp_path / "caps.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"reverse A{i}", "max_new_tokens": cap}) + "\n" for i, cap in enumerate(caps)))
    records, report = load_prompts(DatasetConfig(path=str(path)), tokenizer)
    assert [r.max_new_tokens for r in records] == [5, None]
    assert all("max_new_tokens" not in r.extra for r in records)  # a sampling setting, not a reward input
    assert dict(report.skipped) == {"bad max_new_tokens": 3}
