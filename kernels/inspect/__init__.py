"""Static inspection of the kernels for sm_80 / sm_90 without a GPU: a tool, not part of the
runtime (no module of kernels/ or lmsys/ imports it).

    python -m kernels.inspect [--arch 80,90] [--dtype bf16,fp16] [--json FILE] [--dump DIR] ...

__main__.py    the command: leaves the Triton interpreter, then runs `inspector.main`
inspector.py   the cases (the launchers' own KernelLaunch records on meta tensors), the
               compilations in worker processes, the report and `--update-table`
aot.py         ahead-of-time compilation for a target and what the binary says (registers,
               spills, occupancy, SASS)

It reads the runtime modules (the launchers, kernels/resource_tables.py) and writes the tables
they read (kernels/targets/sm_XX.json); they never import it. Importing this package imports
nothing.
"""
