"""Where the engine runs and how much memory its KV cache gets."""

from __future__ import annotations

import os

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
    return device


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: float32 on a CPU (its fp32 GEMV is the fast path), bfloat16 on a GPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_kv_cache_memory(device: torch.device, useful_bytes: int) -> int:
    """A share of free memory (CPU: a quarter, at most 4 GiB; GPU: 80%), never more than can be used."""
    free = available_memory(device)
    share = int(free * 0.8) if device.type == "cuda" else min(free // 4, 4 << 30)
    return max(1, min(share, useful_bytes))
