"""One training run: the launch (preflight, process group, the run it starts from), the trainer and
its loop, the components that hook into it (faults, the hang watchdog, a bad step's health, the
memory measurement, checkpoint saves), stopping on signals, and what a run reports (console,
metrics.jsonl and W&B, plots)."""
