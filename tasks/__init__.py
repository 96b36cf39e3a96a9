"""Prefect tasks: one per node of the step DAG, each a thin call into the run's Ray actors."""
