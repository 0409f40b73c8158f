"""Test-wide settings."""

import torch

# The suite's models are tiny: one thread is as fast as two for them, and it does not
# slow to a crawl when other processes share the cores (OpenMP threads spin-waiting).
torch.set_num_threads(1)
