"""Training: the worker that owns the policy and its optimizer, micro-batch layouts, the logprob head."""
