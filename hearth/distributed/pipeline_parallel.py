"""Pipeline parallelism: a model's layers split into N contiguous stages, one process each.

A transform of the loaded model, as tensor parallelism is: stage s keeps layers
[s L / N, (s + 1) L / N) (the others are dropped before loading) and the KV cache of those
layers, under the same block tables as every other stage: the engine's KV bookkeeping on rank 0
counts whole tokens, and each stage stores its own layers' K/V of them. Rank 0, the engine's
process, is the first stage and also holds the embeddings and the output layer: it schedules,
computes logits and samples as on one process. The workers (hearth/engine/workers.py) hold
their layers and the final norm.

A step's pass: rank 0 splits the step's sequences into micro-batches (as many as stages, of
about equal rows) and announces them to every worker; then it runs its layers on micro-batch 0
and sends the result to stage 1 ([2, rows, hidden]: the last layer's addition to the residual
stream and the stream), and goes on with micro-batch 1 while stage 1 runs micro-batch 0, and so
down the stages. The last stage applies the final norm and sends each micro-batch's hidden
states [rows, hidden] back to rank 0, which computes logits and samples once all are in. Stages
overlap within a step, not across steps: the next step is scheduled from this one's sampled
tokens (vLLM overlaps steps with one scheduler per stage, its "virtual engines"; one scheduler
keeps hearth's step what it is on one process, and its outputs the same).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import torch
from torch import nn

from hearth.backend.base import Backend, StepInputs
from hearth.config import ModelConfig
from hearth.distributed.collectives import announce_pass, isend, recv, wait
from hearth.errors import ModelLoadError
from hearth.kv_format import KVCaches

LAYER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(.+)")
FIRST_STAGE_ONLY = ("model.embed_tokens.", "lm_head.")  # rank 0 embeds and computes logits


@dataclasses.dataclass(frozen=True)
class PipelineShard:
    rank: int
    world_size: int

    def layers(self, num_layers: int) -> range:
        """The layers of this rank's stage."""
        if num_layers < self.world_size:
            raise ModelLoadError(f"num_layers = {num_layers} does not split into {self.world_size} pipeline stages")
        return range(self.rank * num_layers // self.world_size, (self.rank + 1) * num_layers // self.world_size)

    def config(self, config: ModelConfig) -> ModelConfig:
        """The whole model's config: a stage's layers keep their places in it (windows, experts)."""
        if config.is_hybrid:
            raise ModelLoadError(f"pipeline parallelism does not split hybrid models ({config.architecture}) yet")
        if not config.uniform_kv_cache:
            raise ModelLoadError(f"pipeline parallelism does not split models whose layers' K/V differ in shape or are "
                                 f"shared ({config.architecture}) yet")
        self.layers(config.num_layers)
        return config

    def weights(self, weights: dict, config: ModelConfig) -> dict:
        """This stage's weights (HF names), its layers renumbered from 0 as `select` leaves them."""
        keep = self.layers(config.num_layers)
        stage = {}
        for name, tensor in weights.items():
            if match := LAYER_WEIGHT.fullmatch(name):
                if int(match.group(1)) in keep:
                    stage[f"model.layers.{int(match.group(1)) - keep.start}.{match.group(2)}"] = tensor
            elif self.rank == 0 or not name.startswith(FIRST_STAGE_ONLY):
                stage[name] = tensor
        return stage

    def select(self, model: nn.Module) -> None:
        """Drop, from the model not yet loaded, the layers of other stages (and on workers the
        embeddings and the output layer)."""
        keep = self.layers(len(model.layers))
        model.layers = nn.ModuleList(model.layers[keep.start : keep.stop])
        if self.rank:
            model.embed_tokens = model.lm_head = None

    def wrap(self, model: nn.Module) -> None:
        """Nothing to add once loaded: the stages meet in `forward` and `run`, not inside the modules."""

    def model_pass(self, backend: Backend):
        """Rank 0's pass of a step (the runner's), through every stage."""
        return self.forward

    def forward(self, model: nn.Module, step: StepInputs, kv_caches: KVCaches) -> torch.Tensor:
        """Rank 0: the step through every stage, micro-batch by micro-batch -> [T, hidden] after the final norm."""
        batches = micro_batches(step, self.world_size)
        announce_pass(kv_caches, batches)
        sends = [isend(torch.stack(_stage(model, batch, kv_caches, None)), 1) for batch in batches]
        hidden = [_receive(model, (len(batch.input_ids), model.config.hidden_size), self.world_size - 1)
                  for batch in batches]
        wait(sends)
        return torch.cat(hidden)

    def run(self, model: nn.Module, batches: list[StepInputs], kv_caches: KVCaches) -> None:
        """A worker's stage of the pass rank 0 announced: each micro-batch from the stage before,
        through this stage's layers, to the next (the last: normed, back to rank 0)."""
        last = self.rank == self.world_size - 1
        sends = []
        for batch in batches:
            received = _receive(model, (2, len(batch.input_ids), model.config.hidden_size), self.rank - 1)
            x, residual = _stage(model, batch, kv_caches, received)
            sends.append(isend(model.norm(x, residual)[0], 0) if last else isend(torch.stack((x, residual)),
                                                                                self.rank + 1))
        wait(sends)


def micro_batches(step: StepInputs, count: int) -> list[StepInputs]:
    """The step's sequences in `count` runs (fewer where it has fewer sequences) of about equal rows."""
    count = min(count, step.num_seqs)
    ends = step.query_start_loc[1:]
    cuts = [0]
    for k in range(1, count):
        # at the end of a sequence nearest to k / count of the rows; every run keeps a sequence
        target = k * int(ends[-1]) / count
        after = int(np.searchsorted(ends, target))  # the first sequence ending at or past the target
        cut = after if after and target - ends[after - 1] <= ends[after] - target else after + 1
        cuts.append(min(max(cut, cuts[-1] + 1), step.num_seqs - (count - k)))
    cuts.append(step.num_seqs)
    return [step.sequences(first, end) for first, end in zip(cuts, cuts[1:])]


def _stage(model: nn.Module, step: StepInputs, kv_caches: KVCaches, received: torch.Tensor | None):
    """This stage's layers on one micro-batch: from its tokens (the first stage) or from `received`
    [2, rows, hidden], the stage before's (addition, stream). Returns the same pair."""
    input_ids, positions, meta = model.backend.inputs(model, step)
    if received is None:
        return model.run_layers(model.embed(input_ids), None, positions, kv_caches, meta)
    return model.run_layers(received[0], received[1], positions, kv_caches, meta)


def _receive(model: nn.Module, shape: tuple[int, ...], source: int) -> torch.Tensor:
    return recv(shape, model.dtype, model.norm.weight.device, source)
