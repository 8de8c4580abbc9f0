"""The tools around the system, above every layer: no module of lmsys/, kernels/ or launch/ imports
them.

    tools/bench/     python -m tools.bench [NAME]: benchmarks, each against a baseline measured in
                     the same run (the kernels, the training loop, data preparation, generation,
                     the plan, time to loss, checkpoint saves)
    tools/inspect/   python -m tools.inspect: every kernel compiled for sm_80 / sm_90 without a GPU
                     (registers, spills, occupancy, SASS), and which tiling candidates fit

Importing this package imports nothing.
"""
