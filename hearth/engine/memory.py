"""Where the engine runs and how much memory its KV cache gets."""

from __future__ import annotations

import os
from pathlib import Path

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


# On a CPU a full cache of this many times the weights' bytes is the default's ceiling: a decode step reads
# every running sequence's K/V beside the weights, so with K/V at 4x the weights a memory-bound step already
# gives 80% of the tokens/s that more sequences could approach (bandwidth / (context x bytes per token));
# a larger default buys at most a quarter more and takes RAM the machine may need (issue 31: 4 GiB,
# 93,200 tokens, for a 98 MB SmolLM2 file).
CPU_KV_PER_WEIGHT_BYTE = 4


def model_bytes(path: Path) -> int:
    """The weights' bytes as stored: a GGUF file's size, or an HF folder's safetensors files'."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def kv_cache_budget(device: torch.device, bytes_per_token: int, block_size: int, max_model_len: int,
                    max_num_seqs: int, weight_bytes: int, state_bytes: int = 0) -> int:
    """Bytes for K/V (and a hybrid model's states, state_bytes per sequence) when none is given (vLLM's
    and llama.cpp's kind of default): enough for max_num_seqs contexts of max_model_len tokens (each in
    whole blocks, with room for the token sampled after a full-length prompt: admission asks for prompt +
    1 slots), capped by a share of free memory (GPU: 80%; CPU: a quarter, at most 4 GiB) and, on a CPU, by
    CPU_KV_PER_WEIGHT_BYTE x the weights' bytes, but never below one context while memory allows."""
    context = bytes_per_token * block_size * -(-(max_model_len + 1) // block_size) + state_bytes
    useful = context * max_num_seqs
    free = available_memory(device)
    if device.type == "cuda":
        return max(1, min(int(free * 0.8), useful))
    fits_model = max(CPU_KV_PER_WEIGHT_BYTE * weight_bytes, context)
    return max(1, min(free // 4, 4 << 30, useful, fits_model))


def kv_cache_blocks(budget: int, bytes_per_token: int, block_size: int) -> int:
    """How many blocks of block_size tokens a budget of bytes holds (at least one)."""
    return max(1, budget // (bytes_per_token * block_size))


def state_bytes_per_slot(state_bytes: int, prefix_caching: bool, snapshots: int = 0) -> int:
    """What a state slot costs in the budget: a sequence's states, with prefix caching a checkpoint's
    as many bytes beside it (a checkpoint slot per running slot: hearth/engine/state_slots.py), and with
    speculation a snapshot per guess (the states after each verified guess: hearth/backend/state_ops.py)."""
    return state_bytes * (1 + prefix_caching + snapshots)


def state_slot_count(budget: int, bytes_per_token: int, block_size: int, state_bytes: int, max_num_seqs: int) -> int:
    """How many sequences' states a hybrid model's budget keeps (state_bytes each; 0: the model keeps
    none): one per sequence that may run (max_num_seqs), fewer where the budget cannot hold that many
    states with a KV block each; at least one. The blocks get what the states leave."""
    if not state_bytes:
        return 0
    return max(1, min(max_num_seqs, budget // (state_bytes + bytes_per_token * block_size)))
