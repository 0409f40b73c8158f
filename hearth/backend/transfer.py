"""Copies between the host and the backend's device that do not wait for the work queued there.

With asynchronous scheduling (hearth/engine/overlap.py) the host lays out the next step while the
device still computes the one before: a host-to-device copy that synchronised (torch's default from
pageable memory) would wait for that step, and a device-to-host copy is started with the step and
waited for only when its results are processed. On a CPU both are the tensors themselves.

And a model's weights moved to host RAM and back (a level-1 sleep on a GPU: Backend.release_memory).
"""

from __future__ import annotations

import torch
from torch import nn


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the work queued there (from pinned memory, non-blocking)."""
    device = torch.device(device)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Tensors on their way to the host in one transfer, each to keep its shape and dtype; they travel
    as float64, which holds token ids and float32 values exactly. From a GPU the copy goes into pinned
    memory behind the work queued so far, and only `wait` synchronises (on its event). Tensors on the host
    already are the results themselves: no backend's host results are buffers it fills again (the cpu backend's
    draws are new arrays; the gpu backend's graph buffers, run eagerly on a CPU, are new tensors too), and a
    clone each was ~50 us of a small model's 5 ms step, its caches cold from the weights' stream."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.event = self.host = None
        if not any(t.is_cuda for t in tensors):
            self.host = list(tensors)
            return
        self.layout = [(t.shape, t.dtype) for t in tensors]
        flat = torch.cat([t.reshape(-1).double() for t in tensors])
        self.flat = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        self.flat.copy_(flat, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> list[torch.Tensor]:
        if self.host is not None:
            return self.host
        self.event.synchronize()
        parts = self.flat.split([shape.numel() for shape, _ in self.layout])
        return [part.view(shape).to(dtype) for part, (shape, dtype) in zip(parts, self.layout)]


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy the tensors to the host in one transfer (one synchronisation); each keeps its shape."""
    return HostCopy(tensors).wait()


def move_module(module: nn.Module, device: torch.device) -> int:
    """Copy every parameter and buffer of the module to `device` (to a CPU from a GPU: pinned memory, for a
    quick way back), the old copies let go; the bytes moved. Through Module._apply, the path of .to(), so
    that what holds pointers into the weights (BoundWeights' kernel operands, the decode graphs in a model's
    backend_state) is rebound or dropped; always a copy, also to the same device (the gpu backend's tests
    on a CPU)."""
    tensors = [*module.parameters(), *module.buffers()]
    moved = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    pin = device.type == "cpu" and any(t.is_cuda for t in tensors)

    def copy(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) if pin else t.to(device, copy=True)

    module._apply(copy)
    return moved


def release_unused_device_memory() -> None:
    """Give the GPU memory torch's allocator keeps for reuse back to the driver (after a sleep, an unload),
    so that other processes and models can have it. Nothing on a CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
