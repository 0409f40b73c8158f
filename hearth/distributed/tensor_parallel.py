"""Tensor parallelism: one model split over N processes by attention heads and MLP columns.

A transform of the loaded model, not a branch inside it. Each rank builds the same decoder from a
config with its share of the heads and of the MLP's width, and loads its slice of every weight:
q/k/v and gate/up by rows (column-parallel: each rank computes its own heads and columns), o_proj
and down_proj by columns (row-parallel: each rank's product is a partial sum, added up across
ranks by an all-reduce, which RowParallel inserts after those two modules). Embeddings, norms and
the output layer are whole on every rank. With fewer KV heads than ranks, each KV head is held by
the ranks whose query heads read it. Quantized GGUF weights are split on block boundaries.

Rank 0 is the engine's own process; ranks 1..N-1 are worker processes (gloo on CPUs) that load
the same model and wait. Before each forward pass, rank 0's model broadcasts its inputs
(token ids, positions, attention metadata) and the KV cache's shape; every worker runs the same
pass on its own slice of the KV cache, meeting rank 0 at each all-reduce. Only rank 0 computes
logits and samples.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import socket
import subprocess
import sys
import weakref

import torch
import torch.distributed as dist
from torch import nn

from hearth.config import ModelConfig
from hearth.errors import ModelLoadError
from hearth.quant import QuantTensor

COLUMN_PARALLEL = re.compile(r"\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
ROW_PARALLEL = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$")
TIMEOUT = datetime.timedelta(minutes=30)  # a collective waiting longer than this: a rank is gone


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

    def wrap(self, model: nn.Module) -> None:
        """Add the all-reduce after each row-parallel module; inputs broadcast from rank 0."""
        for layer in model.layers:
            layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj)
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj)
        if self.rank == 0:
            model.register_forward_pre_hook(_broadcast_inputs)


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


# ---- the processes --------------------------------------------------------------------------


def _broadcast_inputs(model: nn.Module, args: tuple) -> None:
    """Rank 0's forward pre-hook: the pass's inputs and KV cache shape, to every worker."""
    input_ids, positions, kv_caches, meta = args
    k_cache = kv_caches[0][0]
    dist.broadcast_object_list([("forward", (input_ids, positions, meta, tuple(k_cache.shape), k_cache.dtype))], src=0)


def start_workers(model_path, world_size: int, dtype: torch.dtype, max_positions: int | None,
                  backend: str) -> "WorkerGroup":
    """Start ranks 1..world_size-1 (each loads its slice) and join them as rank 0. The workers are
    `python -m hearth.distributed.tensor_parallel` processes: nothing of the caller's script is
    imported again. One that loses rank 0 fails its next collective and exits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    threads = max(1, torch.get_num_threads() // world_size)
    processes = [subprocess.Popen([sys.executable, "-m", "hearth.distributed.tensor_parallel", address, str(rank),
                                   str(world_size), str(model_path), str(dtype).removeprefix("torch."),
                                   str(max_positions or 0), backend, str(threads)], stdin=subprocess.DEVNULL)
                 for rank in range(1, world_size)]
    dist.init_process_group("gloo", init_method=address, rank=0, world_size=world_size, timeout=TIMEOUT)
    torch.set_num_threads(threads)
    return WorkerGroup(processes)


class WorkerGroup:
    def __init__(self, processes) -> None:
        self.processes = processes
        self._finalizer = weakref.finalize(self, _end, processes, True)

    def stop(self) -> None:
        """Tell the workers to end, and wait for them."""
        self._finalizer()

    def kill(self) -> None:
        """End the workers without a word (rank 0 failed before they could be told)."""
        self._finalizer.detach()
        _end(self.processes, tell=False)


def _end(processes: list[subprocess.Popen], tell: bool) -> None:
    if dist.is_initialized():
        try:
            if tell and all(p.poll() is None for p in processes):
                dist.broadcast_object_list([("stop", None)], src=0)
        finally:
            dist.destroy_process_group()
    for process in processes:
        try:
            process.wait(10 if tell else 0.1)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _worker_main(address: str, rank: int, world_size: int, model_path: str, dtype: torch.dtype,
                 max_positions: int | None, backend: str, threads: int) -> None:
    from hearth.backend import choose_backend
    from hearth.engine.runner import zeroed
    from hearth.loading.loader import load_model

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size, timeout=TIMEOUT)
    device = torch.device("cpu")
    model = load_model(model_path, dtype, device, max_positions=max_positions, progress=False,
                       backend=choose_backend(device, dtype, backend), shard=TensorShard(rank, world_size)).model
    caches = None
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        kind, payload = message[0]
        if kind == "stop":
            break
        input_ids, positions, meta, shape, kv_dtype = payload
        if caches is None or caches[0][0].shape != shape:
            layers = model.config.num_layers
            flat = zeroed((2 * layers, *shape), kv_dtype, device)
            caches = [(flat[2 * i], flat[2 * i + 1]) for i in range(layers)]
        model(input_ids, positions, caches, meta)
    dist.destroy_process_group()


if __name__ == "__main__":
    address, rank, world, path, dtype, max_positions, backend_name, num_threads = sys.argv[1:]
    _worker_main(address, int(rank), int(world), path, getattr(torch, dtype), int(max_positions) or None,
                 backend_name, int(num_threads))
