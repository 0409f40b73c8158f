"""The worker processes of a model split over ranks (tensor or pipeline parallelism).

Rank 0 is the engine's own process; ranks 1..N-1 are `python -m hearth.engine.workers`
processes (nothing of the caller's script is imported again) that load their shard of the model
and then run what rank 0 broadcasts, until it says stop. A shard (TensorShard, PipelineShard)
says which part of the model a rank holds (`config`, `weights`, `select`, `wrap`: the loader's
steps) and what a worker does with each pass rank 0 announces (`run`). Each worker holds the KV
cache of its own part, allocated on the first pass and again when rank 0's cache shape changes.
A worker ends with the process that started it (the kernel's parent-death signal), and one that
loses rank 0 fails its next collective and exits.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import weakref

import torch
import torch.distributed as dist

from hearth.child_process import die_with_parent
from hearth.distributed.collectives import announce

TIMEOUT = datetime.timedelta(minutes=30)  # a collective waiting longer than this: a rank is gone


def shard_class(kind: str):
    if kind == "tensor":
        from hearth.distributed.tensor_parallel import TensorShard

        return TensorShard
    from hearth.distributed.pipeline_parallel import PipelineShard

    return PipelineShard


def start_split(model_path, tensor_parallel_size: int, pipeline_parallel_size: int, dtype: torch.dtype,
                max_positions: int | None, backend: str, device: torch.device):
    """The worker processes of an engine whose model is split, and rank 0's shard."""
    kind, size = ("tensor", tensor_parallel_size) if tensor_parallel_size > 1 else ("pipeline", pipeline_parallel_size)
    return start_workers(kind, model_path, size, dtype, max_positions, backend, device), shard_class(kind)(0, size)


def start_workers(kind: str, model_path, world_size: int, dtype: torch.dtype, max_positions: int | None,
                  backend: str, device: torch.device) -> "WorkerGroup":
    """Start ranks 1..world_size-1 of a `kind` ("tensor" or "pipeline") split, each loading its
    shard, and join them as rank 0 (see _join for the devices and the collectives' backend). Rank 0's
    store listens on a port the system gives it (not one picked free and bound later: another engine starting
    beside this one could take it in between), which the workers are told."""
    store = rendezvous(world_size)
    threads = max(1, torch.get_num_threads() // world_size)
    processes = [subprocess.Popen([sys.executable, "-m", "hearth.engine.workers", kind, str(store.port), str(rank),
                                   str(world_size), str(model_path), str(dtype).removeprefix("torch."),
                                   str(max_positions or 0), backend, str(threads), device.type],
                                  stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
                 for rank in range(1, world_size)]
    _join(store, 0, world_size, device.type)
    torch.set_num_threads(threads)
    return WorkerGroup(processes)


def rendezvous(world_size: int, port: int = 0) -> dist.TCPStore:
    """The store the ranks meet at: rank 0's (port 0: listening on a port the system picks, store.port), or
    another rank's connection to it."""
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=port == 0, timeout=TIMEOUT,
                         wait_for_workers=False)


def _join(store: dist.TCPStore, rank: int, world_size: int, device_type: str) -> torch.device:
    """Join the process group; this rank's device. On GPUs rank r is on GPU r, with NCCL; with fewer
    GPUs than ranks they share them (rank r on GPU r mod the count) with gloo, as NCCL takes one
    rank a GPU. On CPUs (the gpu backend under Triton's interpreter included), gloo."""
    device, backend = torch.device("cpu"), "gloo"
    if device_type == "cuda":
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", rank % gpus)
        torch.cuda.set_device(device)
        backend = "nccl" if gpus >= world_size else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    return device


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
                announce("stop", None)
        finally:
            dist.destroy_process_group()
    for process in processes:
        try:
            process.wait(10 if tell else 0.1)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _worker_main(kind: str, port: int, rank: int, world_size: int, model_path: str, dtype: torch.dtype,
                 max_positions: int | None, backend: str, threads: int, device_type: str) -> None:
    from hearth.backend import choose_backend
    from hearth.kv_format import allocate_kv_caches
    from hearth.loading.loader import load_model

    torch.set_num_threads(threads)
    device = _join(rendezvous(world_size, port), rank, world_size, device_type)
    shard = shard_class(kind)(rank, world_size)
    # no CUDA graphs in a split model (hearth/engine/engine.py says why)
    model = load_model(model_path, dtype, device, max_positions=max_positions, progress=False,
                       backend=choose_backend(device, dtype, backend, enforce_eager=True), shard=shard).model
    caches = None
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        command, payload = message[0]
        if command == "stop":
            break
        if command == "logits":
            shard.logits(model, payload)
            continue
        num_slots, kv_dtype, work = payload
        if caches is None or caches[0][0].shape[0] != num_slots:  # (a float cache: config.py refuses q8_0 here)
            caches = allocate_kv_caches(model.config, len(model.layers), num_slots, "auto", kv_dtype, device)
        shard.run(model, work, caches)
    dist.destroy_process_group()


if __name__ == "__main__":
    kind_, port_, rank_, world_, path_, dtype_, max_positions_, backend_, threads_, device_ = sys.argv[1:]
    _worker_main(kind_, int(port_), int(rank_), int(world_), path_, getattr(torch, dtype_), int(max_positions_) or None,
                 backend_, int(threads_), device_)
