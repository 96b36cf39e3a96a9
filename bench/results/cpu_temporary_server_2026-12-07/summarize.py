"""Per-run and per-round figures of an A/B folder made by its *.sh: python summarize.py FOLDER"""
import glob
import json
import statistics as st
import sys
from pathlib import Path

runs = {}
for path in sorted(glob.glob(str(Path(sys.argv[1]) / "*_[AB]_[0-9].json"))):
    variant, round_ = Path(path).stem.split("_")[-2:]
    figures = json.load(open(path))
    wall = figures["wall"]
    runs[(round_, variant)] = {"median": st.median(wall), "mean": st.mean(wall), "cpu": st.median(figures["cpu"])}
    print(f"{Path(path).name}: step median {st.median(wall):.3f} (min {min(wall):.3f}, max {max(wall):.3f}, n={len(wall)}), "
          f"mean {st.mean(wall):.3f}, steps over 1.5 s {sum(w > 1.5 for w in wall)}, CPU {st.median(figures['cpu']):.3f} CPU-s a step, "
          f"workers idle {st.median(figures['overhead']):.3f} s a step")
rounds = sorted({r for r, _ in runs})
for key in ("median", "mean", "cpu"):
    ratios = [runs[(r, "B")][key] / runs[(r, "A")][key] for r in rounds]
    print(f"B/A {key}: per round {', '.join(f'{x:.3f}' for x in ratios)}; median {st.median(ratios):.3f}")
