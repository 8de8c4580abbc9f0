"""One training run: the trainer and its step, the launch plan, stopping on signals, and what a
run reports (console, metrics.jsonl and W&B, plots)."""
