"""B/A per round of the two-process A/B in this folder: A = 35e3985 (the steps' artifacts posted while the
step waits), B = the working tree that became 7f196a6 (posted in the background); each file is one run of
bench/trellis_flow_step.py (29 step intervals). Usage: python compare.py FOLDER"""

import json
import statistics as st
import sys

folder = sys.argv[1]
ratios = []
for r in (1, 2, 3, 4):
    a = json.load(open(f"{folder}/srv_A_{r}.json"))
    b = json.load(open(f"{folder}/srv_B_{r}.json"))
    ma, mb = st.median(a["wall"]), st.median(b["wall"])
    ca, cb = a["cpu"][0], b["cpu"][0]
    oa, ob = st.median(a["overhead"]), st.median(b["overhead"])
    ratios.append((mb / ma, cb / ca, ob / oa))
    print(f"round {r}: A {ma:.3f} s (idle {oa:.3f}, CPU {ca:.3f}) B {mb:.3f} s (idle {ob:.3f}, CPU {cb:.3f})  "
          f"B/A step {mb / ma:.3f} CPU {cb / ca:.3f} idle {ob / oa:.3f}")
for i, name in enumerate(("step", "CPU of the process tree", "workers idle")):
    values = [x[i] for x in ratios]
    print(f"B/A {name}: median {st.median(values):.3f} ({min(values):.3f}..{max(values):.3f}, n={len(values)})")
