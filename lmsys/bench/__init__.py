"""Benchmarks of the system against plain baselines measured in the same run (never pass/fail
timings): `train` (the DeepSpeed loop vs a plain PyTorch loop), `prepare` (lmsys-prepare vs
single-process SentencePiece), `generate` (KV cache vs none). Run `python -m lmsys.bench NAME`."""
