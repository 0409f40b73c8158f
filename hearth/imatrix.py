"""The importance matrix (llama.cpp's `llama-imatrix`): for each weight matrix of the layers, the sum
over a calibration text's tokens of each input column's squared activation, and the token count.
`hearth quantize --imatrix` (and llama-quantize) weigh the quantization error of each column by it.

As llama-imatrix does: the text's tokens are cut into chunks of `context` tokens (the remainder
dropped), each chunk's first token replaced by BOS where the model adds one; every token of every
chunk counts; the output projection is left out. The chunks run through the engine's own prefill
(ModelRunner, as perplexity.py) several at once; forward pre-hooks on the attention and MLP
projections (hearth/model/layers.py's MergedLinear for q/k/v and gate/up, o_proj, down_proj) sum
x^2 on the device. The sums go to a file by hearth/loading/imatrix_file.py.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hearth.engine.runner import ModelRunner
from hearth.engine.step_records import BatchEntry
from hearth.errors import HearthError
from hearth.loading.imatrix_file import ImportanceSums
from hearth.loading.names import hf_to_gguf
from hearth.model.layers import MergedLinear
from hearth.model.transformer import Transformer

BLOCK_SIZE = 16
_SINGLE = (".o_proj", ".down_proj")  # the projections that are not parts of a MergedLinear


def hooked_projections(model: Transformer) -> list[tuple[torch.nn.Module, list[str]]]:
    """(module, the GGUF names of the weights that read its input) for every projection in the layers."""
    found = []
    for name, module in model.named_modules():
        prefix = "model." + name
        if isinstance(module, MergedLinear):
            parts = [f"{prefix.rpartition('.')[0]}.{part}.weight" for part in module.part_names]
        elif name.endswith(_SINGLE) and ".parts." not in name:
            parts = [f"{prefix}.weight"]
        else:
            continue
        if ".experts." in name or ".shared_expert." in name:
            raise HearthError("hearth imatrix handles dense models; this one has experts")
        names = [hf_to_gguf(part, model.config.sandwich_norms) for part in parts]
        if None in names:
            raise HearthError(f"{name}: no llama.cpp name for its weights")
        found.append((module, names))
    return found


def compute_imatrix(model: Transformer, token_ids: list[int], context: int, device: torch.device,
                    bos_token_id: int | None = None, max_chunks: int | None = None,
                    max_batch_tokens: int = 2048, on_chunks: Callable[[int], None] | None = None) -> ImportanceSums:
    """The sums and counts over the chunks of `token_ids` (see the module's notes). on_chunks(n): called
    after each forward pass with the chunks it ran (a progress bar)."""
    if context < 16:
        raise HearthError("--ctx must be at least 16 tokens (llama-imatrix ignores smaller batches)")
    chunks = [list(token_ids[s:s + context]) for s in range(0, len(token_ids) - context + 1, context)]
    chunks = chunks[:max_chunks] if max_chunks is not None else chunks
    if not chunks:
        raise HearthError(f"the text has {len(token_ids)} tokens, fewer than one chunk of {context}")
    if bos_token_id is not None:
        for chunk in chunks:
            chunk[0] = bos_token_id
    sums: dict[int, torch.Tensor] = {}
    hooks = []
    modules = hooked_projections(model)
    for index, (module, _) in enumerate(modules):
        def add(_, args, index=index):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[index] = sums[index] + (x * x).sum(0) if index in sums else (x * x).sum(0)

        hooks.append(module.register_forward_pre_hook(add))
    try:
        run_windows(model, chunks, device, max_batch_tokens, on_chunks)
    finally:
        for hook in hooks:
            hook.remove()
    tokens = len(chunks) * context
    result = ImportanceSums(chunks=len(chunks), chunk_size=context)
    for index, (_, names) in enumerate(modules):
        for name in names:
            result.sums[name] = sums[index].cpu().numpy()[None]
            result.counts[name] = np.array([tokens], dtype=np.float64)
    return result


def run_windows(model: Transformer, chunks: list[list[int]], device: torch.device, max_batch_tokens: int,
                on_chunks: Callable[[int], None] | None = None) -> None:
    """Every chunk of tokens through the model's prefill (as many per pass as fit max_batch_tokens),
    for what forward hooks see; on_chunks(n) after each pass of n chunks."""
    context = max(map(len, chunks))
    per_step = max(1, min(len(chunks), max_batch_tokens // context))
    blocks = -(-context // BLOCK_SIZE)
    runner = ModelRunner(model, per_step * blocks, BLOCK_SIZE, device, model.dtype)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(per_step)]
    with torch.inference_mode():
        for first in range(0, len(chunks), per_step):
            step = chunks[first:first + per_step]
            runner.forward([BatchEntry(chunk, 0, table) for chunk, table in zip(step, tables)])
            if on_chunks is not None:
                on_chunks(len(step))
