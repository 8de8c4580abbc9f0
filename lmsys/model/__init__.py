"""The transformer family, single-device: the model read top to bottom (transformer.py), the
per-call choice of Triton kernel or torch reference (ops.py), the KV caches, state-dict names and
shapes (weights.py), and torch.compile (compiling.py). Knows nothing of ZeRO or of the data."""
