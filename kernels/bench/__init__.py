"""The kernel benchmarks: a tool, not part of the runtime (no module of kernels/ or lmsys/ imports
it). Each variant's figures are measured in the same run as its baseline.

    python -m kernels.bench [--smoke] [--dtype bf16|fp16|fp32] [--csv PATH] [--peak-gbps GB/S]
        layer norm and attention against F.layer_norm and torch SDPA, and the issue targets
        (__main__.py: the command; layer_norm.py, attention.py: the measurements; report.py:
        the table and the targets)
    python -m kernels.bench ce [--n N --d D --v V] [--repeat R] [--model]
        the linear cross-entropy's peak memory and time, each variant in a fresh process (ce.py)
    python -m kernels.bench.attention [--smoke] [--dtype bf16|fp16|fp32]
        the attention rows alone

Importing this package imports nothing (the command chooses the Triton interpreter before triton
is imported).
"""
