"""Producing batches: the controller, one batch at a time or a producer in the background under a
staleness bound, with its replay buffer, dynamic sampling, task mix and prompt ledger."""
