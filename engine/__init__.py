"""The RL machinery, usable without Prefect: one folder per concern (see the README's Architecture)."""
