"""Advantage estimators, policy losses and evaluation metrics: pure torch functions, testable on CPU."""
