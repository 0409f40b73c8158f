"""Asynchronous scheduling (hearth/engine/overlap.py): the engine one step ahead of what the host has
read gives exactly what the synchronous engine gives. On SmolLM2's real weights (cpu backend) and on
a small random model through the gpu backend (Triton's interpreter, graphs with capture off, without
a GPU): greedy and seeded tokens, texts, finish reasons and logprobs with the overlap on and off,
with stop strings, EOS, n > 1, structured output and penalties (their steps run synchronously) in
one batch, preemption in a tiny KV cache, aborts mid-run, and speculation (n-gram and a draft model)
with its acceptance counts. The other tests run the engine with the overlap on (the default), so
the references there (transformers, llama.cpp's outputs) hold for it too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.sampling_params import StructuredOutputsParams
from models import VOCAB_SIZE, make_hf_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct"
GGUF = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smollm2 = pytest.mark.skipif(not GGUF.exists(), reason=f"reference data not found: {DATA}")

PROMPTS = ["The capital of France is", "Once upon a time, there was a little", "def fibonacci(n):",
           "List three colors:", "1, 2, 3, 4,"]


def _mixed_params() -> list[SamplingParams]:
    """One batch of what the output side does differently: a stop string, EOS, n > 1 seeded draws,
    logprobs, a grammar and a penalty (these two run their steps synchronously)."""
    return [
        SamplingParams(temperature=0, max_tokens=24, stop=[" is", "."]),
        SamplingParams(temperature=0, max_tokens=40),  # may end on EOS
        SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, max_tokens=16,
                       structured_outputs=StructuredOutputsParams(choice=["red, green, blue", "cyan"])),
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),
    ]


def _seen(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted(p.items()) for p in c.logprobs]) for c in o.outputs]
            for o in outputs]


def _run(llm: LLM, prompts, params) -> list:
    return _seen(llm.generate(prompts, params, use_tqdm=False))


@pytest.fixture(scope="module")
def smollm2():
    if not GGUF.exists():
        pytest.skip(f"reference data not found: {DATA}")
    return {on: LLM(str(GGUF), progress=False, backend="cpu", async_scheduling=on) for on in (True, False)}


@needs_smollm2
def test_outputs_are_the_synchronous_engines_with_every_kind_of_request_in_one_batch(smollm2):
    """The mixed batch, and the plain greedy one that runs ahead on every step: the same outputs."""
    assert smollm2[True].engine.overlap is not None and smollm2[False].engine.overlap is None
    for params in (_mixed_params(), SamplingParams(temperature=0, max_tokens=20, stop=["\n\n"])):
        assert _run(smollm2[True], PROMPTS, params) == _run(smollm2[False], PROMPTS, params)


@needs_smollm2
def test_the_engine_runs_one_step_ahead_and_drops_the_extra_draw_of_a_stopped_request(smollm2):
    """Step by step: the first step returns nothing (its tokens are still being computed), each
    later one the step before's; a request that a stop string ends has had one more token computed,
    never appended, and every KV block is free once the requests are done."""
    engine = smollm2[True].engine
    params = SamplingParams(temperature=0, max_tokens=30, stop=["Paris"])
    engine.add_request("a", PROMPTS[0], params)
    assert engine.step() == [] and engine.overlap.in_flight is not None
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "stop"
    expected = smollm2[False].generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert outputs[-1].outputs[0].token_ids == expected.token_ids and "Paris" not in outputs[-1].outputs[0].text
    # the step computing the draw after "Paris" is still in flight: the next step drops what it drew
    assert [r.request_id for r, _ in engine.overlap.in_flight.plan.scheduled] == ["a"]
    assert engine.overlap.in_flight.plan.scheduled[0][0].num_output_tokens == len(expected.token_ids)
    assert engine.block_manager.num_free_blocks == engine.num_blocks


@needs_smollm2
def test_aborts_mid_run_free_their_blocks_and_leave_the_others_as_they_were(smollm2):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = _run(smollm2[False], PROMPTS[:3], params)
    engine = smollm2[True].engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, params)
    finished = {}
    for step in range(40):
        if step == 5:  # in flight: its draw is dropped when the step comes back
            assert engine.abort_request("1")
        for output in engine.step():
            assert output.request_id != "1" or step < 5
            if output.finished:
                finished[output.request_id] = _seen([output])[0]
        if not engine.has_unfinished_requests():
            break
    assert finished == {"0": expected[0], "2": expected[2]}
    assert engine.block_manager.num_free_blocks == engine.num_blocks


@needs_smollm2
def test_preemption_in_a_tiny_kv_cache_gives_the_same_tokens():
    """Room for about two contexts of the five: requests are preempted and recomputed (some while
    their draw is in flight), the outputs are the synchronous engine's."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seen, preemptions = {}, {}
    for on in (True, False):
        llm = LLM(str(GGUF), progress=False, backend="cpu", async_scheduling=on,
                  kv_cache_memory=LLM_KV_BYTES_PER_TOKEN * 16 * 9)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        seen[on], preemptions[on] = _seen(outputs), sum(o.metrics.num_preemptions for o in outputs)
    assert preemptions[True] > 0 and preemptions[False] > 0
    assert seen[True] == seen[False]


LLM_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32


@needs_smollm2
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_keeps_its_tokens_and_its_acceptance(method):
    """Speculative steps run synchronously: the same tokens and the same acceptance counts on and off."""
    options = dict(speculative_method=method, num_speculative_tokens=3, speculative_adaptive=False)
    if method == "draft":
        options["speculative_model"] = str(GGUF)
    else:
        options["prompt_lookup_min"] = 1
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seen, counts = {}, {}
    for on in (True, False):
        llm = LLM(str(GGUF), progress=False, backend="cpu", async_scheduling=on, **options)
        seen[on] = _run(llm, ["1, 2, 3, 1, 2, 3, 1, 2,", PROMPTS[1]], params)
        counts[on] = llm.engine.spec_decode_totals
    assert seen[True] == seen[False]
    assert counts[True] == counts[False] and counts[True].num_accepted_tokens > 0


@pytest.mark.slow  # ~13 s of CPU under Triton's interpreter
def test_gpu_backend_runs_ahead_with_the_draws_on_the_device(tmp_path):
    """The gpu backend (Triton's interpreter and graphs with capture off without a GPU): decode
    steps fed the draws of the step before where they are, the outputs the synchronous engine's,
    with a stop token, n > 1 and preemption in a small cache."""
    folder = make_hf_model(tmp_path, "llama", num_hidden_layers=1)  # one layer: half the interpreter's CPU of two
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[(7 * i + j) % (VOCAB_SIZE - 2) + 2 for j in range(3 + 4 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[5, 9, 11]),
              SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=5),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    seen = {}
    for on in (True, False):
        llm = LLM(folder, device=device, dtype="float32", backend="gpu", kv_cache_memory=1 << 14,  # 4 blocks
                  max_num_batched_tokens=32, progress=False, async_scheduling=on)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
        seen[on] = _seen(outputs)
    assert seen[True] == seen[False]
