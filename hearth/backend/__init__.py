"""Execution backends, one chosen per engine: the kernels a model's layers run.

- `cpu` (hearth/backend/cpu.py): float32 on a CPU through hearth's C++ kernels.
- `gpu` (hearth/backend/gpu.py): Triton kernels, CUDA graphs for decode, GGUF weights kept
  quantized on the device.
- `reference` (hearth/backend/base.py): torch's operations, any device and dtype; what the
  others are tested against, and what runs where neither applies (a CPU in bfloat16, no compiler).
"""

from __future__ import annotations

import os

import torch

from hearth.backend.base import Backend, DecodeSampling, SaturationChecks, StepInputs

BACKENDS = ("auto", "cpu", "gpu", "reference")


def choose_backend(device: torch.device, dtype: torch.dtype, name: str = "auto", enforce_eager: bool = False
                   ) -> Backend:
    """The backend for a model on `device` computing in `dtype`; `name` forces one ("auto": the
    fastest that applies). enforce_eager: no CUDA graphs (gpu backend)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        if device.type == "cuda":
            name = "gpu"
        else:
            from hearth.backend.cpu_ops import cpu_kernels

            name = "cpu" if dtype == torch.float32 and cpu_kernels() is not None else "reference"
    if name == "cpu":
        from hearth.backend.cpu import CpuBackend

        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError("the cpu backend runs float32 on a CPU")
        return CpuBackend()
    if name == "gpu":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the gpu backend needs a CUDA device (or Triton's interpreter: TRITON_INTERPRET=1)")
        from hearth.backend.gpu import GpuBackend

        return GpuBackend(device, use_cuda_graphs=device.type == "cuda" and not enforce_eager)
    return Backend(device)


__all__ = ["Backend", "DecodeSampling", "SaturationChecks", "StepInputs", "choose_backend"]
