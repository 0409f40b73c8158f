"""Pipeline parallelism (hearth/distributed/pipeline_parallel.py): two stages give one process's outputs."""

from __future__ import annotations

import numpy as np
import pytest

from hearth import LLM, SamplingParams
from hearth.backend.base import StepInputs
from hearth.distributed.pipeline_parallel import PipelineShard, micro_batches
from hearth.errors import ModelLoadError
from hearth.loading.convert import convert_hf_to_gguf
from models import make_hf_model

PROMPTS = [f"Once upon a time there were {i} foxes" + " and a hen" * (i % 4) for i in range(16)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# a KV cache for about 8 of the 16 requests, prompts in chunks of 32 tokens: preemption and chunked prefill
TIGHT = dict(kv_cache_memory=96 * 1024, max_num_batched_tokens=32)


def greedy_runs(model, prompt_sets, **options) -> tuple[list[list[list[int]]], int, LLM]:
    """Each set's greedy tokens, its prompts all queued at once, one set after the other on one
    engine; the preemptions on the way (every KV block free after each set); the LLM, closed."""
    llm = LLM(model, progress=False, **options)
    engine = llm.engine
    results, preempted = [], 0
    try:
        for prompts in prompt_sets:
            ids = [engine.add_request(None, prompt, GREEDY) for prompt in prompts]
            tokens = {}
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        tokens[output.request_id] = output.outputs[0].token_ids
                preempted += engine.last_step.num_preempted
            assert engine.block_manager.check_all_free()
            results.append([tokens[i] for i in ids])
        return results, preempted, llm
    finally:
        engine.close()


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {"num_hidden_layers": 3}),  # stages of 1 and 2 layers
    ("gemma2", {"num_hidden_layers": 4}),  # alternating sliding layers keep their places in the stages
])
def test_two_stages_give_one_process_greedy_tokens(tmp_path, arch, overrides):
    """One request alone (one micro-batch: the stages take turns), then 16 at once (two micro-batches
    a step, the stages overlapping), with chunked prefill and preemption; the worker gone after."""
    folder = make_hf_model(tmp_path / arch, arch, **overrides)
    expected, _, _ = greedy_runs(folder, ([PROMPTS[0]], PROMPTS), **TIGHT)
    tokens, preempted, llm = greedy_runs(folder, ([PROMPTS[0]], PROMPTS), pipeline_parallel_size=2, **TIGHT)
    assert tokens == expected
    assert preempted > 0  # 16 at once outgrew the cache
    assert all(p.poll() is not None for p in llm.engine.workers.processes)


def test_quantized_gguf_in_two_stages(tmp_path):
    """A q8_0 GGUF: decode steps run each stage's layers in one C++ call (cpu_decode.py), the second
    stage's starting from the stream it was sent; chunked prefill and preemption in the mix."""
    folder = make_hf_model(tmp_path / "llama", "llama", num_hidden_layers=4, intermediate_size=128)
    path = convert_hf_to_gguf(folder, tmp_path / "model-q8_0.gguf", "q8_0", progress=False)
    expected, _, _ = greedy_runs(path, [PROMPTS], **TIGHT)
    tokens, preempted, llm = greedy_runs(path, [PROMPTS], pipeline_parallel_size=2, **TIGHT)
    assert tokens == expected and preempted > 0
    assert llm.engine.model.backend_state.get("decode_path") is not None  # the one-call path ran on rank 0


def test_micro_batches_split_sequences_into_runs_of_about_equal_rows():
    lens = np.array([5, 1, 1, 1, 1, 1, 6, 1], dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    rows = int(starts[-1])
    step = StepInputs(np.arange(rows), np.arange(rows), np.arange(rows), starts, lens + 3,
                      np.arange(16, dtype=np.int32).reshape(8, 2), 16)
    batches = micro_batches(step, 3)
    assert [b.num_seqs for b in batches] == [2, 4, 2]  # rows 6, 4, 7 of 17
    assert np.array_equal(np.concatenate([b.input_ids for b in batches]), step.input_ids)
    assert np.array_equal(np.concatenate([b.block_tables for b in batches]), step.block_tables)
    assert [b.query_start_loc.tolist() for b in batches][1] == [0, 1, 2, 3, 4]
    assert len(micro_batches(step.sequences(0, 1), 2)) == 1  # one sequence: one micro-batch


def test_stages_split_layers_and_refuse_what_does_not_split():
    assert [PipelineShard(rank, 3).layers(8) for rank in range(3)] == [range(0, 2), range(2, 5), range(5, 8)]
    with pytest.raises(ModelLoadError, match="num_layers = 2 does not split into 3 pipeline stages"):
        PipelineShard(0, 3).layers(2)
    with pytest.raises(ValueError, match="tensor and pipeline parallelism together"):
        LLM("builtin", progress=False, pipeline_parallel_size=2, tensor_parallel_size=2)
