"""Tensor parallelism (hearth/distributed/tensor_parallel.py): two ranks give one process's outputs."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.distributed as dist

from hearth import LLM, SamplingParams
from hearth.distributed.tensor_parallel import TensorShard, VocabParallelEmbedding, VocabParallelHead, _rows
from hearth.errors import ModelLoadError
from hearth.loading.convert import convert_hf_to_gguf
from hearth.quant import QuantTensor
from models import make_hf_model

PROMPTS = [f"Once upon a time there were {i} foxes" + " and a hen" * (i % 4) for i in range(16)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def greedy_tokens(model, **options) -> list[list[int]]:
    llm = LLM(model, progress=False, **options)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {"vocab_size": 321}),  # vocabulary rows 160 and 161 a rank
    ("qwen2", {}),  # q/k/v biases split with their rows
    ("qwen3", {"tie_word_embeddings": True}),  # q/k norms on each rank's heads; tied: the embedding's slice
])  # fewer KV heads than ranks: test_a_model_that_does_not_split_is_refused_by_name
def test_two_ranks_give_one_process_greedy_tokens(tmp_path, arch, overrides):
    folder = make_hf_model(tmp_path / arch, arch, **overrides)
    assert greedy_tokens(folder, tensor_parallel_size=2) == greedy_tokens(folder)


@pytest.mark.parametrize("out_type, overrides", [
    ("q8_0", {"vocab_size": 321}),  # token_embd and output in q8_0 blocks, 160 and 161 rows a rank
    ("q4_1", {"tie_word_embeddings": True}),  # no output tensor: each rank's output layer is its token_embd rows
])
def test_quantized_gguf_splits_on_block_boundaries(tmp_path, out_type, overrides):
    """GGUF blocks split between ranks by rows (whole blocks: the projections' rows, the vocabulary's),
    with chunked prefill and preemption in the mix (a KV cache smaller than the batch needs)."""
    folder = make_hf_model(tmp_path / "llama", "llama", intermediate_size=128, **overrides)
    path = convert_hf_to_gguf(folder, tmp_path / f"model-{out_type}.gguf", out_type, progress=False)
    options = dict(kv_cache_memory=256 * 1024, max_num_batched_tokens=64)
    assert greedy_tokens(path, tensor_parallel_size=2, **options) == greedy_tokens(path, **options)


SMOLLM2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct"


@pytest.mark.skipif(not SMOLLM2.exists(), reason=f"reference data not found: {SMOLLM2}")
def test_three_ranks_on_a_real_q4_1_model_give_one_process_logits():
    """SmolLM2-135M's Q4_1 GGUF over 3 ranks (3 heads, 1 KV head, 512 MLP columns, 192 hidden
    columns a rank): the cpu backend rounds activations to int8, so any float32 difference between
    the split and one process could move a value across a rounding step; o_proj and down_proj
    computed over their whole input on each rank keep every sum as one process adds it. The prompt
    log-probabilities of llama.cpp's reference prompts are one process's bit for bit, and so are the
    greedy tokens."""
    import json

    greedy = json.loads((SMOLLM2 / "llamacpp_reference.json").read_text())["greedy"][:4]
    prompts = [case["prompt_ids"] for case in greedy]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)

    def run(**options):
        llm = LLM(SMOLLM2 / "SmolLM2-135M-Instruct.Q4_1.gguf", progress=False, **options)
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.close()
        return ([o.outputs[0].token_ids for o in outputs],
                [[position[t] for position, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outputs, prompts)])

    assert run(tensor_parallel_size=3) == run()


def test_row_slices_of_blocks_dequantize_to_slices_of_the_matrix():
    """Every rank's quantized slice (rows: whole blocks, a view of the file's bytes) equals gguf's
    dequantization of the whole, sliced; the ranks' shares (3 ranks, 8 rows: 2, 3, 3) cover every row once."""
    rng = np.random.default_rng(0)
    q8_0 = gguf.quants.quantize(rng.normal(size=(8, 256)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    q4_k = rng.integers(0, 256, size=(8, 2 * 144), dtype=np.uint8)  # two Q4_K blocks a row: random codes...
    q4_k.reshape(8, 2, 144)[:, :, :4] = np.frombuffer(np.float16([0.01, 0.002]).tobytes(), np.uint8)  # ...d, dmin
    for data, qtype, cols in ((q8_0, gguf.GGMLQuantizationType.Q8_0, 256), (q4_k, gguf.GGMLQuantizationType.Q4_K, 512)):
        weight = QuantTensor(torch.from_numpy(data), qtype, (8, cols))
        reference = gguf.quants.dequantize(data, qtype)
        shares = [TensorShard(rank, 3).share(8) for rank in range(3)]
        assert [len(share) for share in shares] == [2, 3, 3] and [r for s in shares for r in s] == list(range(8))
        for share in shares:
            part = _rows(weight, share.start, len(share))
            assert part.data.data_ptr() == weight.data[share.start].data_ptr()  # no copy
            np.testing.assert_array_equal(part.dequantize().numpy(), reference[share.start : share.stop])


def test_a_model_that_does_not_split_is_refused_by_name(tmp_path):
    folder = make_hf_model(tmp_path / "llama", "llama", num_attention_heads=3, num_key_value_heads=1,
                           hidden_size=48)
    with pytest.raises(ModelLoadError, match="num_heads = 3 does not split over 2 ranks"):
        LLM(folder, progress=False, tensor_parallel_size=2)
    # the workers were ended: the next tensor-parallel engine can start in this process; with fewer KV
    # heads than ranks, each rank holds the one, and the tokens are one process's
    folder = make_hf_model(tmp_path / "ok", "llama", num_key_value_heads=1)
    assert greedy_tokens(folder, tensor_parallel_size=2) == greedy_tokens(folder)


def test_rank_configs_split_heads_and_width():
    from hearth.config import ModelConfig

    config = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    rank = TensorShard(1, 4).config(config)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size, rank.head_dim) == (2, 1, 32, 8)


def _vocabulary_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An odd vocabulary (11 rows: 5 and 6 a rank) of width 8, ids on both sides of the boundary
    with repeats, and 3 hidden states; the same on every rank (seeded)."""
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(11, 8, generator=generator)
    hidden = torch.randn(3, 8, generator=generator)
    return table, torch.tensor([10, 0, 4, 5, 6, 5, 1]), hidden


def _vocabulary_rank(rank: int, store) -> None:
    """One of two gloo ranks (meeting at `store`, rank 0's or the port of it): the vocabulary-parallel modules on its
    rows; rank 0 checks what it gets."""
    from hearth.engine.workers import rendezvous

    table, ids, hidden = _vocabulary_inputs()
    store = rendezvous(2, int(store)) if isinstance(store, str) else store
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        shares = [TensorShard(r, 2).vocabulary(len(table)) for r in range(2)]
        rows = table[shares[rank].start : shares[rank].stop]
        embedding = VocabParallelEmbedding(torch.nn.Embedding.from_pretrained(rows), shares[rank])
        head = VocabParallelHead(torch.nn.Linear(table.shape[1], len(rows), bias=False), shares)
        head.inner.weight.data = rows
        vectors, logits = embedding(ids), head(hidden)
        if rank == 0:
            torch.testing.assert_close(vectors, table[ids], rtol=0, atol=0)  # one rank's row plus zeros: exact
            torch.testing.assert_close(logits, hidden @ table.T)
        else:
            assert logits is None  # only rank 0 samples
    finally:
        dist.destroy_process_group()


def test_vocabulary_parallel_modules_equal_the_whole_table():
    """Over two gloo ranks (this process rank 0, a child rank 1): every id's vector from the rank
    holding it, and the logits of all 11 tokens in order on rank 0."""
    from hearth.engine.workers import rendezvous

    store = rendezvous(2)  # (on a port the system gives it: no race with a test beside this one for a free port)
    # a plain child (not torch.multiprocessing's spawn, which imports pytest and this module's imports again)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                              "from test_tensor_parallel import _vocabulary_rank; _vocabulary_rank(1, sys.argv[2])",
                              str(Path(__file__).parent), str(store.port)])
    try:
        _vocabulary_rank(0, store)
        assert child.wait(60) == 0
    finally:
        child.kill()
        child.wait()
