"""Rollout backends behind one contract (``base``): the transformers loop, vLLM, a pool of engines, and
the table that builds the one a config names (``registry``)."""
