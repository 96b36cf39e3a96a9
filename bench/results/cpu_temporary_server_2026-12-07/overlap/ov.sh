#!/bin/bash
cd /work/main/bench
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for v in $order; do
    if [ $v = B ]; then export TRELLIS_BENCH_OVERLAP=1; else export TRELLIS_BENCH_OVERLAP=0; fi
    timeout 900 ../.venv/bin/python trellis_flow_step.py /tmp/prof/tiny /tmp/prof/train.parquet 30 /tmp/prof/ov_${v}_${r}.json > /tmp/prof/ov_${v}_${r}.log 2>&1
    echo "$r $v rc=$? $(date +%T)"
  done
done
