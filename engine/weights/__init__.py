"""Moving weights between a trainer and a rollout engine: buckets, CUDA IPC, broadcast groups (torch only)."""
