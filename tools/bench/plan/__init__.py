"""The planner against measured runs: the grid (`grid.py`, `python -m tools.bench plan`) and the
probe each of its runs is (`tensor_trace.py`: one rank's training with the peak of its CPU
tensors)."""
