"""Where the engine runs and how much memory its KV cache gets, and how a hybrid model's budget is shared
between its states and K/V (split_budget)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hearth.engine_config import DEFAULT_MAX_NUM_SEQS
from hearth.errors import HearthError

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


def context_bytes(bytes_per_token: int, block_size: int, max_model_len: int) -> int:
    """K/V bytes of one full-length request: max_model_len tokens in whole blocks, with room for the token
    sampled after a full-length prompt (admission asks for prompt + 1 slots)."""
    return bytes_per_token * block_size * -(-(max_model_len + 1) // block_size)


def kv_cache_budget(device: torch.device, bytes_per_token: int, block_size: int, max_model_len: int,
                    max_num_seqs: int | None, weight_bytes: int, state_bytes: int = 0) -> int:
    """Bytes for K/V (and a hybrid model's states, state_bytes per sequence) when none is given (vLLM's
    and llama.cpp's kind of default): enough for max_num_seqs (None: DEFAULT_MAX_NUM_SEQS) contexts of
    max_model_len tokens, each with its states, capped by a share of free memory (GPU: 80%; CPU: a quarter,
    at most 4 GiB) and, on a CPU, by CPU_KV_PER_WEIGHT_BYTE x the weights' bytes, but never below one
    context (and the states of the max_num_seqs given, split_budget's floor) while memory allows."""
    context = context_bytes(bytes_per_token, block_size, max_model_len)
    useful = (context + state_bytes) * (max_num_seqs or DEFAULT_MAX_NUM_SEQS)
    free = available_memory(device)
    if device.type == "cuda":
        return max(1, min(int(free * 0.8), useful))
    fits_model = max(CPU_KV_PER_WEIGHT_BYTE * weight_bytes, context + state_bytes * (max_num_seqs or 1))
    return max(1, min(free // 4, 4 << 30, useful, fits_model))


def kv_cache_blocks(budget: int, bytes_per_token: int, block_size: int) -> int:
    """How many blocks of block_size tokens a budget of bytes holds (at least one)."""
    return max(1, budget // (bytes_per_token * block_size))


def state_bytes_per_slot(state_bytes: int, prefix_caching: bool, snapshots: int = 0) -> int:
    """What a state slot costs in the budget: a sequence's states, with prefix caching a checkpoint's
    as many bytes beside it (a checkpoint slot per running slot: hearth/engine/state_slots.py), and with
    speculation a snapshot per guess (the states after each verified guess: hearth/backend/state_ops.py)."""
    return state_bytes * (1 + prefix_caching + snapshots)


@dataclass(frozen=True)
class BudgetSplit:
    """A KV budget shared out: a hybrid model's state slots (0: a model without states), the bytes left to
    K/V, and why that many slots (a phrase for the start-up line and `hearth inspect`; empty without states)."""

    state_slots: int
    kv_bytes: int
    why: str = ""


def split_budget(budget: int, bytes_per_token: int, block_size: int, max_model_len: int, slot_bytes: int,
                 max_num_seqs: int | None) -> BudgetSplit:
    """How a budget is shared between a hybrid model's state slots (slot_bytes each, state_bytes_per_slot)
    and K/V (bytes_per_token). The one place that decides it:

    1. The floor: one state slot, and K/V for one max_model_len request (context_bytes) where the budget
       holds both; where it does not, the one slot and all the rest to K/V (the longest request it then
       serves is shorter: the start-up line says so). A budget without room for one slot and one block is
       refused.
    2. max_num_seqs given: that many slots, refused (HearthError, naming what fits) where their states and
       one max_model_len of K/V do not fit together.
    3. Otherwise, balanced: as many slots as the budget holds whole sequences of max_model_len tokens, each
       its states beside its K/V (budget // (slot_bytes + context_bytes)), at most DEFAULT_MAX_NUM_SEQS;
       K/V gets the rest, so every running sequence can reach max_model_len without preempting another
       (what vLLM reports as its "maximum concurrency" for max_model_len tokens per request, and what the
       default budget is sized by, kv_cache_budget: it gives exactly max_num_seqs slots where memory allows).
       A fixed split has to guess the sequences' length: guessing shorter buys more slots but preempts
       (recomputes) sequences when they grow; states cost the K/V of hundreds of tokens each (Qwen3.5-0.8B:
       19.3 MiB, 822 tokens of K/V, twice that with prefix caching), so slots sized for
       max_num_seqs first (the old split) left 1 GiB with 944 tokens of K/V. Traffic of short requests
       asks for more slots by name (max_num_seqs) or by a shorter max_model_len. (vLLM shares one pool of
       pages between Mamba states and attention blocks, its attention block grown to a state's page, so
       the split follows the traffic; llama.cpp keeps n_seq_max states, its --parallel, beside n_ctx
       tokens of K/V, both named by the user.)"""
    if not slot_bytes:
        return BudgetSplit(0, budget)
    block_bytes, context = bytes_per_token * block_size, context_bytes(bytes_per_token, block_size, max_model_len)
    if budget < slot_bytes + block_bytes:
        raise HearthError(f"kv_cache_memory {_size(budget)} holds not even one sequence's states "
                          f"({_size(slot_bytes)}) and one KV block ({_size(block_bytes)}): give a larger one")
    most = max(1, (budget - context) // slot_bytes)  # slots beside one max_model_len of K/V (the floor: one)
    if max_num_seqs is not None:
        if max_num_seqs > most:
            raise HearthError(
                f"max_num_seqs {max_num_seqs}: kv_cache_memory {_size(budget)} holds the states of at most {most} "
                f"sequences ({_size(slot_bytes)} each) beside K/V for one {max_model_len:,}-token request "
                f"({_size(context)}): give max_num_seqs {most} or less, a larger kv_cache_memory or a smaller "
                "max_model_len")
        return BudgetSplit(max_num_seqs, budget - max_num_seqs * slot_bytes, "max_num_seqs, as given")
    if budget < slot_bytes + context:
        return BudgetSplit(1, budget - slot_bytes, f"the budget holds less than one {max_model_len:,}-token "
                                                   "request with its states: one sequence, K/V all the rest")
    slots = min(DEFAULT_MAX_NUM_SEQS, budget // (slot_bytes + context))
    why = f"the default max_num_seqs ({DEFAULT_MAX_NUM_SEQS})" if slots == DEFAULT_MAX_NUM_SEQS else \
        f"as many as the budget holds {max_model_len:,}-token requests with their states"
    return BudgetSplit(slots, budget - slots * slot_bytes, why)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} bytes"
