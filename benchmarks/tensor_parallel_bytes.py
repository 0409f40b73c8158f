#!/usr/bin/env python
"""The bytes of weights each tensor-parallel rank holds, with the vocabulary split and without.

Not a timing: each rank's model is loaded in this one process (`load_model(..., shard=TensorShard(r, N))`,
no process group needed until a pass runs) and its parameters and buffers are added up, as loaded
on the CPU in float32 (GGUF blocks kept as the cpu backend keeps them). "Whole vocabulary" is what a
rank held before the embedding table and the output layer were split: its bytes less its slice of
those two, plus the whole of them.

    python benchmarks/tensor_parallel_bytes.py MODEL --ranks N
"""

from __future__ import annotations

import argparse

from torch import nn

from common import table  # (importing common puts the repository on sys.path)

from hearth.distributed.tensor_parallel import TensorShard
from hearth.loading.loader import load_model


def nbytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers, a tensor shared by two (tied embeddings) once."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


def vocabulary_bytes(model: nn.Module) -> int:
    return nbytes(nn.ModuleList([model.embed_tokens, model.lm_head]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    whole = load_model(args.model, progress=False).model
    whole_vocabulary = vocabulary_bytes(whole)
    rows = [["one process", f"{nbytes(whole):,}", f"{whole_vocabulary:,}", ""]]
    for rank in range(args.ranks):
        model = load_model(args.model, progress=False, shard=TensorShard(rank, args.ranks)).model
        split, vocabulary = nbytes(model), vocabulary_bytes(model)
        rows.append([f"rank {rank} of {args.ranks}", f"{split:,}", f"{vocabulary:,}",
                     f"{split - vocabulary + whole_vocabulary:,}"])
    print(table(["", "bytes", "of which embedding + output", "with the whole vocabulary"], rows))


if __name__ == "__main__":
    main()
