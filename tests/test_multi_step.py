"""Multi-step decoding (speculative_method "multi-step": hearth/engine/speculation/multi_step.py and
hearth/engine/chain_passes.py): a greedy request's next k + 1 tokens in one kernel call.

Its tokens must be plain greedy decoding's, which test_engine holds to transformers and test_smollm2
to llama.cpp; here the same engine without it is the reference, on the built-in model (F16, lm_head
tied to the embedding), a q8_0 GGUF and, where ../shared has it, SmolLM2's Q4_1 file: alone and
batched, cut by max_tokens, stop tokens and stop strings in the middle of a step's tokens, beside
requests that sample; every KV block free at the end. Models the kernel cannot run are refused by name.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hearth import LLM, SamplingParams
from hearth.errors import HearthError
from models import VOCAB_SIZE, make_hf_model

SMOLLM2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
STEPS = 4  # guesses a step: 5 tokens a kernel call


def kernels_or_skip() -> None:
    from hearth.backend.cpu import cpu_kernels
    from hearth.quant import kernels

    if kernels.extension() is None or cpu_kernels() is None:
        pytest.skip("the C++ kernels could not be built here")


@pytest.fixture(scope="module")
def q8_0_model(tmp_path_factory) -> str:
    from hearth.loading.convert import convert_hf_to_gguf

    root = tmp_path_factory.mktemp("multi-step")
    folder = make_hf_model(root / "llama", "llama", intermediate_size=128)  # whole q8_0 blocks
    return str(convert_hf_to_gguf(folder, root / "model.gguf", "q8_0", progress=False))


def prompts_for(model: str) -> list:
    if model == "builtin" or model.endswith("Q4_1.gguf"):  # text prompts for real vocabularies
        return ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "The capital of France is",
                "class Stack:\n    def push(self, item):", "1, 2, 3, 4,"]
    rng = random.Random(3)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(2, 30))] for _ in range(5)]


def outputs(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[tuple[list[int], str, str | None]]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("model", ["builtin", "q8_0", "smollm2"])
def test_multi_step_keeps_plain_greedy_outputs(model, q8_0_model):
    """Greedy requests of several lengths (max_tokens ending inside a step's tokens), alone and five at
    once: plain decoding's tokens, texts and finish reasons; every guess kept, in steps of k + 1 tokens."""
    kernels_or_skip()
    if model == "smollm2" and not SMOLLM2.exists():
        pytest.skip(f"reference data not found: {SMOLLM2}")
    path = {"builtin": "builtin", "q8_0": q8_0_model, "smollm2": str(SMOLLM2)}[model]
    prompts = prompts_for(path)
    params = [SamplingParams(temperature=0, max_tokens=9 + 7 * i, ignore_eos=True) for i in range(len(prompts))]
    expected = outputs(LLM(path, progress=False), prompts, params)
    llm = LLM(path, progress=False, speculative_method="multi-step", num_speculative_tokens=STEPS,
              speculative_adaptive=False)
    assert outputs(llm, prompts, params) == expected
    assert [outputs(llm, [p], [q])[0] for p, q in zip(prompts, params)] == expected
    totals = llm.engine.spec_decode_totals
    assert totals.num_accepted_tokens == totals.num_draft_tokens > 0
    assert totals.num_draft_tokens >= sum(q.max_tokens for q in params) // 2  # (two runs: most tokens chained)
    assert llm.engine.block_manager.check_all_free()


def test_stops_inside_a_step_keep_plain_outputs(q8_0_model):
    """A stop token, a stop string and EOS (the model's own) reached in the middle of a step's tokens
    end the request where plain decoding ends it; beside them a seeded sampled request and one with a
    repetition penalty (the sampler draws theirs: no step guesses while they run) keep plain decoding's too."""
    kernels_or_skip()
    plain = LLM(q8_0_model, progress=False)
    prompts = prompts_for(q8_0_model)
    free_run = outputs(plain, prompts[:3], [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3)
    stop_token = free_run[0][0][6]  # the seventh token: inside the second step of five
    stop_text = plain.get_tokenizer().decode(free_run[1][0][8:10])
    params = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop=[stop_text], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(temperature=0.8, seed=11, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3)]
    expected = outputs(plain, prompts, params)
    assert expected[0][2] == "stop" and len(expected[0][0]) <= 7
    assert expected[1][2] == "stop"
    llm = LLM(q8_0_model, progress=False, speculative_method="multi-step", num_speculative_tokens=STEPS,
              speculative_adaptive=False)
    assert outputs(llm, prompts, params) == expected
    assert [outputs(llm, [p], [q])[0] for p, q in zip(prompts, params)] == expected
    assert llm.engine.spec_decode_totals.num_accepted_tokens > 0
    assert llm.engine.block_manager.check_all_free()


def test_a_model_off_the_greedy_kernel_is_refused(tmp_path):
    """A float32 HF folder (a dense embedding: the greedy kernel does not read it) is refused by name
    rather than verifying placeholder guesses every step."""
    kernels_or_skip()
    folder = make_hf_model(tmp_path / "llama", "llama")
    with pytest.raises(HearthError, match="multi-step"):
        LLM(folder, progress=False, speculative_method="multi-step")


def test_preempted_and_aborted_requests_keep_plain_outputs_and_free_every_block(q8_0_model):
    """A cache of 10 blocks for 8 requests (preemption: their chained slots taken back and recomputed) and
    aborts mid-way: the requests that finish get plain decoding's tokens, and every block is free at the end."""
    kernels_or_skip()
    kv_bytes_per_token = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x head_dim 16 x float32
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(3, 12))] * 3 for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(q8_0_model, progress=False).generate(prompts, params,
                                                                                        use_tqdm=False)]
    engine = LLM(q8_0_model, progress=False, kv_cache_memory=10 * 16 * kv_bytes_per_token,
                 speculative_method="multi-step", num_speculative_tokens=STEPS, speculative_adaptive=False).engine
    ids = [engine.add_request(None, prompt, params) for prompt in prompts]
    finished, preempted = {}, 0
    for step in range(1000):
        if not engine.has_unfinished_requests():
            break
        finished.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        preempted += engine.last_step.num_preempted
        if step == 6:
            for request_id in ids[::4]:
                engine.abort_request(request_id)
    assert not engine.has_unfinished_requests() and preempted > 0
    kept = [i for i in range(len(ids)) if i % 4]
    assert {ids[i]: list(finished[ids[i]]) for i in kept} == {ids[i]: expected[i] for i in kept}
    counts = engine.spec_decode_totals  # (a step with a recomputed prompt in it verifies its placeholders instead)
    assert counts.num_draft_tokens > 0 and counts.num_accepted_tokens >= counts.num_draft_tokens // 2
    assert engine.block_manager.check_all_free()


def test_prefix_cache_keeps_the_blocks_chained_steps_wrote(q8_0_model):
    """Blocks filled by chained steps (their K/V written by the kernel's later passes) reach the prefix
    cache: requests that share them afterwards get plain decoding's tokens from the hits."""
    kernels_or_skip()
    rng = random.Random(4)
    shared = [rng.randrange(VOCAB_SIZE) for _ in range(20)]
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    llm = LLM(q8_0_model, progress=False, enable_prefix_caching=True, speculative_method="multi-step",
              num_speculative_tokens=STEPS, speculative_adaptive=False)
    first = llm.generate([shared], params, use_tqdm=False)[0].outputs[0].token_ids  # 48 tokens: 3 full blocks
    # the next prompts begin with the first request's whole text: blocks its chained steps wrote
    prompts = [shared + list(first) + [rng.randrange(VOCAB_SIZE)] for _ in range(3)]
    plain = LLM(q8_0_model, progress=False, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    hits = llm.engine.block_manager.prefix_cache_hits
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert llm.engine.block_manager.prefix_cache_hits - hits >= 3 * 32  # two blocks each, the second chained steps wrote
    assert llm.engine.block_manager.check_all_free()


def test_greedy_kernel_refuses_a_position_past_the_rope_table():
    """The greedy kernel reads each row's cos and sin from the model's rope tables at the row's position
    (cpu_kernels/decode_layers.cpp's greedy_passes): a position past the tables' end is an IndexError that
    names them, not a read past their end."""
    from hearth.engine.step_records import BatchEntry

    kernels_or_skip()
    runner = LLM("builtin", progress=False).engine.runner
    position = runner.model.rope.max_positions
    entry = BatchEntry([5], position, [0] * (position // runner.block_size + 1))
    with pytest.raises(IndexError, match=f"position {position} outside the rope table's {position} rows"):
        runner.backend.greedy_passes(runner.model, runner.prepare([entry]), None, [], runner.kv_caches)
