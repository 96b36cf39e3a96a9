"""Rollout: backends (transformers, vLLM) behind one contract, producing and scoring batches, the controller."""
