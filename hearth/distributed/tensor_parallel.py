"""Tensor parallelism: one model split over N processes by attention heads and MLP columns.

A transform of the loaded model, not a branch inside it. Each rank builds the same decoder from a
config with its share of the heads and of the MLP's width, and loads its slice of every weight, all
by rows (whole GGUF blocks): q/k/v and gate/up (column-parallel: each rank computes its own heads
and columns), and o_proj and down_proj too (GatheredColumns: the ranks' inputs, their heads' and
columns' outputs, gathered whole on every rank, each rank computes its share of the hidden
columns over the whole input, and those are gathered). The embedding table and the output layer
are split by vocabulary rows (VocabParallelEmbedding, VocabParallelHead); norms are whole on every
rank. With fewer KV heads than ranks, each KV head is held by the ranks whose query heads read it.

Why o_proj and down_proj are not row-parallel (each rank a partial sum over its share of the
input, added up by an all-reduce, as Megatron does): that sum adds the same products in another
order than one process does, so the results differ in their last bits; where the next matmul
rounds its activations to int8 (GGUF weights on the cpu backend, as llama.cpp) such a difference
now and then moves a value across a rounding boundary, a whole int8 step, and the logits drift by
the quantization's own error (SmolLM2 Q4_1 over 3 ranks: prompt log-probabilities 0.068 nats apart
on average, 2 of 4 greedy continuations parting at near ties). Every output computed over the whole
input by the same kernel as in one process is the same number: tensor-parallel ranks give one
process's logits bit for bit (the kernels' sums do not depend on the rows or threads beside
them), at the cost of two all-gathers where the all-reduce was one.

Rank 0 is the engine's own process; ranks 1..N-1 are worker processes (hearth/engine/workers.py)
that load their slice and wait. Before each forward pass rank 0 broadcasts the step (its host
arrays) and the KV cache's shape; every worker runs the same pass on its own slice of the KV
cache, meeting rank 0 at each all-reduce. For logits rank 0 broadcasts the rows of hidden states
it wants them for; every rank computes its vocabulary slice's, gathered on rank 0, which alone
samples.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist
from torch import nn

from hearth.backend.base import Backend, StepInputs
from hearth.config import ModelConfig
from hearth.distributed.collectives import _through_host, announce, announce_pass, gather_to_first
from hearth.errors import ModelLoadError
from hearth.model.layers import Linear
from hearth.model.transformer import vocabulary_modules
from hearth.quant import QuantTensor

COLUMN_PARALLEL = re.compile(r"\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
GATHERED = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$")  # rows of the hidden size
VOCABULARY_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")  # split by rows (tokens)


@dataclasses.dataclass(frozen=True)
class TensorShard:
    rank: int
    world_size: int

    def config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's slice: its heads, its KV heads, its share of the MLP."""
        world = self.world_size
        if getattr(config, "num_experts", 0):
            raise ModelLoadError("tensor parallelism does not split mixture-of-experts models yet")
        if config.is_hybrid:
            raise ModelLoadError(f"tensor parallelism does not split hybrid models ({config.architecture}) yet")
        if not config.uniform_kv_cache:
            raise ModelLoadError(f"tensor parallelism does not split models whose layers' K/V differ in shape or are "
                                 f"shared ({config.architecture}) yet")
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
        tokens = self.vocabulary(config.vocab_size)
        sliced = {}
        for name, tensor in weights.items():
            if name in VOCABULARY_PARALLEL:  # (tied embeddings: the output layer takes the embedding's slice)
                sliced[name] = _rows(tensor, tokens.start, len(tokens))
            elif match := COLUMN_PARALLEL.search(name):
                part = match.group(1)
                start, size = {"self_attn.q_proj": (self.rank * q_rows, q_rows),
                               "self_attn.k_proj": (kv_first, kv_rows),
                               "self_attn.v_proj": (kv_first, kv_rows)}.get(part, (self.rank * mlp_rows, mlp_rows))
                sliced[name] = _rows(tensor, start, size)
            elif GATHERED.search(name):
                hidden = self.share(config.hidden_size)
                sliced[name] = _rows(tensor, hidden.start, len(hidden))
            else:
                sliced[name] = tensor
        return sliced

    def vocabulary(self, vocab_size: int) -> range:
        """The tokens of this rank's rows of the embedding table and the output layer."""
        if vocab_size < self.world_size:
            raise ModelLoadError(f"vocab_size = {vocab_size} does not split over {self.world_size} ranks")
        return self.share(vocab_size)

    def share(self, rows: int) -> range:
        """This rank's part of `rows` rows: the ranks' shares differ by at most one row (the first
        ranks hold the fewer)."""
        return range(self.rank * rows // self.world_size, (self.rank + 1) * rows // self.world_size)

    def select(self, model: nn.Module) -> None:
        """Every module stays, each to hold a slice (taken by `weights`): the embedding table and
        the output layer, of this rank's tokens only; o_proj and down_proj, of this rank's hidden
        columns over the whole input (every rank's heads, the MLP's whole width)."""
        config, world = model.config, self.world_size
        hidden = len(self.share(config.hidden_size))
        with torch.device("meta"):
            model.embed_tokens, model.lm_head = vocabulary_modules(len(self.vocabulary(config.vocab_size)),
                                                                   config.hidden_size)
            for layer in model.layers:
                o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
                layer.self_attn.o_proj = Linear(world * o_proj.weight.shape[1], hidden, o_proj.bias is not None)
                layer.mlp.down_proj = Linear(world * down_proj.weight.shape[1], hidden, down_proj.bias is not None)

    def wrap(self, model: nn.Module) -> None:
        """Add the gathers around o_proj and down_proj, the all-reduce after the embedding, the
        gather after the output layer; on rank 0, the announcement of the rows logits are computed for."""
        hidden_shares = [TensorShard(r, self.world_size).share(model.config.hidden_size)
                         for r in range(self.world_size)]
        for layer in model.layers:
            layer.self_attn.o_proj = GatheredColumns(layer.self_attn.o_proj, hidden_shares)
            layer.mlp.down_proj = GatheredColumns(layer.mlp.down_proj, hidden_shares)
        vocab_size = model.config.vocab_size
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, self.vocabulary(vocab_size))
        model.lm_head = VocabParallelHead(model.lm_head, [TensorShard(r, self.world_size).vocabulary(vocab_size)
                                                          for r in range(self.world_size)])
        if self.rank == 0:
            model.lm_head.register_forward_pre_hook(_broadcast_hidden)

    def model_pass(self, backend: Backend):
        """Rank 0's pass of a step (the runner's): announced to the workers, then the backend's."""

        def forward(model: nn.Module, step: StepInputs, kv_caches: list) -> torch.Tensor:
            announce_pass(kv_caches, step)
            return backend.forward(model, step, kv_caches)

        return forward

    def run(self, model: nn.Module, step: StepInputs, kv_caches: list) -> None:
        """A worker's share of the pass rank 0 announced: the same pass on its slice."""
        model.backend.forward(model, step, kv_caches)

    @torch.inference_mode()
    def logits(self, model: nn.Module, rows: tuple[tuple[int, ...], torch.dtype]) -> None:
        """A worker's share of the logits rank 0 announced (the shape and dtype of its hidden rows,
        broadcast next): its vocabulary slice's, gathered on rank 0."""
        shape, dtype = rows
        hidden = torch.empty(shape, dtype=dtype, device=model.norm.weight.device)
        dist.broadcast(hidden, src=0)
        model.lm_head(hidden)


class GatheredColumns(nn.Module):
    """A projection of the ranks' inputs side by side (each rank's heads or MLP columns, in rank
    order: the whole input of one process), each rank computing its share of the output columns;
    every rank gets the whole output."""

    def __init__(self, inner: nn.Module, shares: list[range]) -> None:
        super().__init__()
        self.inner, self.shares = inner, shares

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, this rank's inputs] -> [T, hidden]
        return _gather_columns(self.inner(_gather_columns(x, None)), self.shares)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table: its tokens' vectors, zeros for the others, summed
    over the ranks (every token's vector, from the rank that holds it)."""

    def __init__(self, inner: nn.Module, tokens: range) -> None:
        super().__init__()
        self.inner, self.tokens = inner, tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        mine = (input_ids >= self.tokens.start) & (input_ids < self.tokens.stop)
        x = self.inner(torch.where(mine, input_ids - self.tokens.start, 0))
        x = x.masked_fill(~mine[:, None], 0)
        dist.all_reduce(x)
        return x


class VocabParallelHead(nn.Module):
    """This rank's rows of the output layer: the logits of its tokens, gathered on rank 0 in
    vocabulary order (None on the other ranks)."""

    def __init__(self, inner: nn.Module, shares: list[range]) -> None:
        super().__init__()
        self.inner, self.shares = inner, shares
        self.width = max(len(share) for share in shares)  # gather takes one shape: shorter slices padded

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N, vocab]
        logits = self.inner(hidden)
        parts = gather_to_first(nn.functional.pad(logits, (0, self.width - logits.shape[1])))
        return None if parts is None else torch.cat([p[:, : len(s)] for p, s in zip(parts, self.shares)], dim=1)


def _rows(tensor, start: int, size: int):
    """Rows start..start+size-1 of a weight (a view: a QuantTensor's rows are whole blocks)."""
    if isinstance(tensor, QuantTensor):
        return tensor.row_range(start, size)
    return tensor[start : start + size]


def _gather_columns(x: torch.Tensor, shares: list[range] | None) -> torch.Tensor:
    """Every rank's x [T, its columns] side by side in rank order, on every rank. shares: each
    rank's columns where they may differ in number (then padded to the widest for the gather);
    None where every rank has as many."""
    width = x.shape[1] if shares is None else max(len(share) for share in shares)
    part = nn.functional.pad(x, (0, width - x.shape[1])).contiguous()
    host = _through_host(part.device)  # gloo gathers host tensors only
    part = part.cpu() if host else part
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, part)
    if shares is not None:
        parts = [p[:, : len(share)] for p, share in zip(parts, shares)]
    return torch.cat(parts, dim=1).to(x.device)


# ---- rank 0's announcements ---------------------------------------------------------------


def _broadcast_hidden(head: nn.Module, args: tuple) -> None:
    """Rank 0's forward pre-hook on the output layer: the hidden rows [N, hidden] logits are
    wanted for, to every worker."""
    (hidden,) = args
    announce("logits", (tuple(hidden.shape), hidden.dtype))
    dist.broadcast(hidden.contiguous(), src=0)
