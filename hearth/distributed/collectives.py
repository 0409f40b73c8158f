"""The collectives the ranks of a split model meet in, on CPU or CUDA tensors.

NCCL (rank r on GPU r) takes CUDA tensors in every collective. gloo (CPUs, and ranks sharing
GPUs) takes CUDA tensors in broadcast and all_reduce only: its send, recv and gather take host
tensors (torch.distributed's table of backends), so a CUDA tensor goes through host memory there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _through_host(device: torch.device) -> bool:
    return device.type != "cpu" and dist.get_backend() == "gloo"


def isend(tensor: torch.Tensor, destination: int) -> tuple[dist.Work, torch.Tensor]:
    """Start sending; the tensor sent is kept with the handle until the send is waited for."""
    tensor = tensor.contiguous()
    if _through_host(tensor.device):
        tensor = tensor.cpu()
    return dist.isend(tensor, destination), tensor


def wait(sends: list[tuple[dist.Work, torch.Tensor]]) -> None:
    for work, _ in sends:
        work.wait()


def recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, source: int) -> torch.Tensor:
    buffer = torch.empty(shape, dtype=dtype, device="cpu" if _through_host(device) else device)
    dist.recv(buffer, source)
    return buffer.to(device)


def gather_to_first(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's `tensor` (one shape on all), in rank order, on rank 0; None on the others."""
    device = tensor.device
    part = tensor.contiguous().cpu() if _through_host(device) else tensor.contiguous()
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(part, parts, dst=0)
    return None if parts is None else [p.to(device) for p in parts]


def announce_pass(kv_caches: list[tuple[torch.Tensor, ...]], work) -> None:
    """Rank 0: tell every worker to run a pass (`work`: what its shard's `run` takes), with the
    slots and dtype of its caches (a worker's are of its own layers and heads)."""
    k_cache = kv_caches[0][0]
    announce("forward", (k_cache.shape[0], k_cache.dtype, work))


def announce(command: str, payload) -> None:
    """Rank 0: a command to every worker ("forward", "logits", "stop"), with what it takes."""
    dist.broadcast_object_list([(command, payload)], src=0)
