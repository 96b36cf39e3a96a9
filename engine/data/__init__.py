"""Prompt datasets, the prompt sampler, the rollout sample record and the training sequences made of it."""
