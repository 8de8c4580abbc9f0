"""Static inspection of the kernels for sm_80 / sm_90 without a GPU: a tool, not part of the
runtime (no module of kernels/ or lmsys/ imports it).

    python -m tools.inspect [--arch 80,90] [--dtype bf16,fp16] [--json FILE] [--dump DIR] ...
    python -m tools.inspect --candidates ...     which configs of a wider set pass, per kernel

__main__.py    the command: leaves the Triton interpreter, then runs `inspector.main`
inspector.py   the cases (the launchers' own KernelLaunch records on meta tensors), the
               compilations in worker processes, the report, and the candidates mode
aot.py         ahead-of-time compilation for a target and what the binary says (registers,
               spills, occupancy, SASS)

It reads the runtime modules (the launchers, the candidate lists, kernels.runtime's pruning); they
never import it. Importing this package imports nothing.
"""
