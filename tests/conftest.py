"""Test-wide settings."""

import os

import torch

# The suite's models are tiny: one thread is as fast as two for them, and it does not
# slow to a crawl when other processes share the cores (OpenMP threads spin-waiting).
torch.set_num_threads(1)

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (read when a kernel
# is decorated, so before any hearth module that defines one is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
