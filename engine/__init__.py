"""The RL machinery, usable without Prefect: one folder per concern (see docs/architecture.md)."""
