#!/bin/bash
cd /work/main/bench
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for v in $order; do
    if [ $v = B ]; then export PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE=200 PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL=1; else unset PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL; fi
    timeout 900 ../.venv/bin/python trellis_flow_step.py /tmp/prof/tiny /tmp/prof/train.parquet 30 /tmp/prof/rec_${v}_${r}.json > /tmp/prof/rec_${v}_${r}.log 2>&1
    echo "$r $v rc=$? $(date +%T)"
  done
done
