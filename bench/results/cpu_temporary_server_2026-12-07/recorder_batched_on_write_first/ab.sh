#!/bin/bash
# A: main (write lock first, recorder batch 1); B: same code, recorder batched (200 events / 1 s)
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for v in $order; do
    cd /work/main/bench
    if [ $v = B ]; then export PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE=200 PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL=1; else unset PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL; fi
    PYTHONPATH=/work/main timeout 900 /work/main/.venv/bin/python trellis_flow_step.py /tmp/prof/tiny /tmp/prof/train.parquet 30 /tmp/ab1/srv_${v}_${r}.json > /tmp/ab1/srv_${v}_${r}.log 2>&1
    echo "$r $v rc=$? $(date +%T)"
  done
done
