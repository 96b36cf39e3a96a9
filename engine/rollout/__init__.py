"""Rollout, by concern, each below the next: ``backends`` (transformers, vLLM, a pool; one contract),
``agents`` (how a sample's response is made), ``rewards`` (scoring), ``production`` (batches, the
producer, the controller). ``bounded_calls`` runs user code for rewards and tools alike."""
