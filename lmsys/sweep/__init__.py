"""Sweeps: running them (`multirun`: Hydra expansion, checks, multirun glue) and reading them
back (`summary`: table, CSV, plot; `python -m lmsys.sweep summarize SWEEP_DIR`)."""
