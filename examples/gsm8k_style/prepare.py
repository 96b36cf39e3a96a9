"""Build this example's model and data in this folder, offline: a tiny Qwen2 warmed up on the task in
model/, and a Hugging Face dataset (train and test splits, GSM8K's columns) saved to data/.

    python prepare.py
"""

from pathlib import Path

from datasets import Dataset, DatasetDict
from task import make_example, make_rows

from trellis.engine.tiny.model import build_tiny_checkpoint

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    build_tiny_checkpoint(HERE / "model", make_example=make_example, warmup_steps=60, warmup_seed=3)
    splits = {"train": Dataset.from_list(make_rows(2048, seed=0)), "test": Dataset.from_list(make_rows(128, seed=1))}
    DatasetDict(splits).save_to_disk(HERE / "data")
    print(f"model: {HERE / 'model'}, dataset: {HERE / 'data'}")
