"""Triton kernels for NVIDIA GPUs (run in Triton's interpreter on CPU tensors in the tests)."""
