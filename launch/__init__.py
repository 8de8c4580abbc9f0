"""How lmsys jobs start: torchrun on one node or many (`launch/torchrun.py`), SLURM
(`launch/slurm.sbatch`), and sweeps whose jobs are torchrun launches (`launch/sweep.py`).
Recipes from one CPU to N nodes x 8 GPUs, with the batch arithmetic of each: launch/README.md.

Run them from the repository root: `python -m launch.torchrun ...`, `python -m launch.sweep ...`
(or `python launch/torchrun.py ...`); `sbatch launch/slurm.sbatch ...`.
"""
