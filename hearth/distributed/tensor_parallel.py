"""Tensor parallelism: one model split over N processes by attention heads and MLP columns.

A transform of the loaded model, not a branch inside it. Each rank builds the same decoder from a
config with its share of the heads and of the MLP's width, and loads its slice of every weight:
q/k/v and gate/up by rows (column-parallel: each rank computes its own heads and columns), o_proj
and down_proj by columns (row-parallel: each rank's product is a partial sum, added up across
ranks by an all-reduce, which RowParallel inserts after those two modules). Embeddings, norms and
the output layer are whole on every rank. With fewer KV heads than ranks, each KV head is held by
the ranks whose query heads read it. Quantized GGUF weights are split on block boundaries.

Rank 0 is the engine's own process; ranks 1..N-1 are worker processes (hearth/distributed/workers.py,
gloo on CPUs) that load their slice and wait. Before each forward pass, rank 0's model broadcasts
its inputs (token ids, positions, attention metadata) and the KV cache's shape; every worker runs
the same pass on its own slice of the KV cache, meeting rank 0 at each all-reduce. Only rank 0
computes logits and samples.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist
from torch import nn

from hearth.backend.base import Backend
from hearth.config import ModelConfig
from hearth.distributed.workers import announce_pass
from hearth.errors import ModelLoadError
from hearth.quant import QuantTensor

COLUMN_PARALLEL = re.compile(r"\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
ROW_PARALLEL = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$")


@dataclasses.dataclass(frozen=True)
class TensorShard:
    rank: int
    world_size: int

    def config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's slice: its heads, its KV heads, its share of the MLP."""
        world = self.world_size
        if getattr(config, "num_experts", 0):
            raise ModelLoadError("tensor parallelism does not split mixture-of-experts models yet")
        for name, value in (("num_heads", config.num_heads), ("intermediate_size", config.intermediate_size)):
            if value % world:
                raise ModelLoadError(f"{name} = {value} does not split over {world} ranks")
        kv = config.num_kv_heads
        if kv % world and world % kv:
            raise ModelLoadError(f"num_kv_heads = {kv} neither splits over {world} ranks nor divides them")
        return dataclasses.replace(config, num_heads=config.num_heads // world, num_kv_heads=max(1, kv // world),
                                   intermediate_size=config.intermediate_size // world)

    def weights(self, weights: dict, config: ModelConfig) -> dict:
        """This rank's slice of every weight (HF names), for the full model's `config`."""
        rank_config = self.config(config)
        head_dim = config.head_dim
        q_rows = rank_config.num_heads * head_dim
        kv_rows = rank_config.num_kv_heads * head_dim
        # the KV head(s) this rank's query heads read: its own share, or the one it replicates
        kv_first = self.rank * config.num_kv_heads // self.world_size * head_dim
        mlp_rows = rank_config.intermediate_size
        sliced = {}
        for name, tensor in weights.items():
            if match := COLUMN_PARALLEL.search(name):
                part = match.group(1)
                start, size = {"self_attn.q_proj": (self.rank * q_rows, q_rows),
                               "self_attn.k_proj": (kv_first, kv_rows),
                               "self_attn.v_proj": (kv_first, kv_rows)}.get(part, (self.rank * mlp_rows, mlp_rows))
                sliced[name] = _rows(tensor, start, size)
            elif match := ROW_PARALLEL.search(name):
                if match.group(2) == "bias":  # added once, after the sum: rank 0 keeps it
                    sliced[name] = tensor if self.rank == 0 else torch.zeros(tuple(tensor.shape))
                else:
                    width = tensor.shape[1] // self.world_size
                    sliced[name] = _columns(tensor, self.rank * width, width, name)
            else:
                sliced[name] = tensor
        return sliced

    def select(self, model: nn.Module) -> None:
        """Every module stays: each rank holds a slice of each (taken by `weights`)."""

    def wrap(self, model: nn.Module) -> None:
        """Add the all-reduce after each row-parallel module; inputs broadcast from rank 0."""
        for layer in model.layers:
            layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj)
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj)
        if self.rank == 0:
            model.register_forward_pre_hook(_broadcast_inputs)

    def model_pass(self, backend: Backend):
        """Rank 0's pass of a step (the runner's): the backend's, announced by wrap's pre-hook."""
        return backend.forward

    def run(self, model: nn.Module, work: tuple, kv_caches: list) -> None:
        """A worker's share of the pass rank 0 announced: the same pass on its slice."""
        input_ids, positions, meta = work
        model(input_ids, positions, kv_caches, meta)


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over all ranks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        dist.all_reduce(y)
        return y


def _rows(tensor, start: int, size: int):
    if isinstance(tensor, QuantTensor):
        return tensor.rows(torch.arange(start, start + size))
    return tensor[start : start + size]


def _columns(tensor, start: int, size: int, name: str):
    if not isinstance(tensor, QuantTensor):
        return tensor[:, start : start + size]
    block = tensor.block_size
    if start % block or size % block:
        raise ModelLoadError(f"{name}: {tensor.shape[1]} columns in blocks of {block} do not split over the ranks "
                             "on block boundaries")
    rows, bytes_per_block = tensor.shape[0], tensor.data.shape[1] * block // tensor.shape[1]
    blocks = tensor.data.reshape(rows, -1, bytes_per_block)[:, start // block : (start + size) // block]
    return QuantTensor(blocks.reshape(rows, -1).contiguous(), tensor.qtype, (rows, size))


# ---- rank 0's passes, a worker's ---------------------------------------------------------


def _broadcast_inputs(model: nn.Module, args: tuple) -> None:
    """Rank 0's forward pre-hook: the pass's inputs, to every worker."""
    input_ids, positions, kv_caches, meta = args
    announce_pass(kv_caches, (input_ids, positions, meta))
