"""The benchmarks: each prints its figures beside a baseline measured in the same run (never
pass/fail timings). `python -m tools.bench NAME [options]` (__main__.py) runs one:

    kernels      layer norm and attention against F.layer_norm and torch SDPA, and the Llama
                 family's kernels (RMS norm, rotary, SwiGLU, grouped-query and packed-documents
                 attention) against their torch paths: one table and the GPU targets
                 (kernel_table.py; the rows in layer_norm.py, attention.py and llama.py, the table
                 and targets in report.py); `attention` and `layer_norm` run their rows alone,
                 `kernels --only llama` the Llama family's
    ce           the linear cross-entropy's peak memory and time, each variant in a fresh process
    train        the DeepSpeed training loop against a plain PyTorch loop on the same model
    prepare      lmsys-prepare against single-process SentencePiece
    generate     generation with the KV cache against none, batched against one by one
    plan         lmsys-plan's memory and step time against measured runs
    ttl          time to loss: Muon against AdamW over seeds
    checkpoint   the loop's stall per asynchronous save against a synchronous one
    integrity    what opening prepared data costs, by check, against the full check

`python -m tools.bench` alone runs `kernels`, then `train` (what `make bench` runs). Without CUDA
the kernels run in Triton's CPU interpreter (chosen before triton is imported): their timings only
prove the code path there. Importing this package imports nothing.
"""
