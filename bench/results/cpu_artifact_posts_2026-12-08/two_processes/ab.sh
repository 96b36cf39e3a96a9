#!/bin/bash
# A: 35e3985 (worktree /tmp/wtA); B: working tree (the steps' artifacts posted in the background on trellis's temporary server)
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for v in $order; do
    if [ $v = A ]; then root=/tmp/wtA; else root=/work/main; fi
    cd $root/bench
    PYTHONPATH=$root timeout 900 /work/main/.venv/bin/python trellis_flow_step.py /tmp/prof/tiny /tmp/prof/train.parquet 30 /tmp/ab3/srv_${v}_${r}.json > /tmp/ab3/srv_${v}_${r}.log 2>&1
    echo "$r $v rc=$? $(date +%T)"
  done
done
