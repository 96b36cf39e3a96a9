"""Running a run: the run plan and step plan, the step's order, resume, preflight, the in-process runner."""
