"""Build this example's model and data in this folder: a tiny Qwen2 warmed up on the sort task
(~40% greedy accuracy, room to learn) in model/, train and held-out prompts in data/.

    python prepare.py
"""

from pathlib import Path

from task import make_example, write_prompts

from trellis.engine.tiny.model import build_tiny_checkpoint

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    build_tiny_checkpoint(HERE / "model", make_example=make_example, warmup_steps=50, warmup_seed=8)
    write_prompts(HERE / "data" / "train.parquet", 2048, seed=0)
    write_prompts(HERE / "data" / "eval.parquet", 128, seed=1)
    print(f"model: {HERE / 'model'}, prompts: {HERE / 'data'}")
