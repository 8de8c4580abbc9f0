"""Test-wide set-up. Runs before any test module imports triton."""

import os

import torch

# Without a GPU, Triton kernels run on CPU tensors through the interpreter. It must be chosen
# before `triton` is first imported, which is why it lives here and not in a fixture.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep CPU tests reproducible and fast on small machines.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
