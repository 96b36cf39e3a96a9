#!/bin/bash
# A: d1cf4d8 (worktree /tmp/wtA); B: working tree (one-certificate CA file for the step loop over plain HTTP)
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for v in $order; do
    if [ $v = A ]; then root=/tmp/wtA; else root=/work/main; fi
    cd $root/bench
    PYTHONPATH=$root timeout 900 /work/main/.venv/bin/python trellis_flow_step.py /tmp/prof/tiny /tmp/prof/train.parquet 30 /tmp/ab2/srv_${v}_${r}.json > /tmp/ab2/srv_${v}_${r}.log 2>&1
    echo "$r $v rc=$? $(date +%T)"
  done
done
