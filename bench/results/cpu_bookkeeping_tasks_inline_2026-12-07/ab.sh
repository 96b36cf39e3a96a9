#!/bin/bash
cd /work/main/bench
for r in 1 2 3 4; do
  for v in A B; do
    if [ $v = B ]; then export TRELLIS_INLINE_PHASES=log_step,write_trajectories; else unset TRELLIS_INLINE_PHASES; fi
    if [ $((r % 2)) = 0 ]; then :; fi
    timeout 900 ../.venv/bin/python trellis_flow_step.py /tmp/prof/tiny /tmp/prof/train.parquet 30 /tmp/prof/ab_${v}_${r}.json > /tmp/prof/ab_${v}_${r}.log 2>&1
    echo "$r $v rc=$? $(date +%T)"
  done
done
