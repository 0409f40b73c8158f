"""The gpu backend (Triton kernels, CUDA graphs) through the whole engine: greedy outputs against
transformers, and decode graphs against the eager path. Without a GPU it runs on the CPU under
Triton's interpreter (tests/conftest.py), graphs with capture off; with one, on the GPU."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.backend.graphs import bucket_sizes
from models import ARCHITECTURES, VOCAB_SIZE, load_hf_reference, make_hf_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _prompts(count: int, seed: int, shortest: int = 2, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(shortest, longest))] for _ in range(count)]


def _llm(folder, **options) -> LLM:
    # float32: greedy tokens comparable with transformers'; small token budget: prompts in chunks
    return LLM(folder, device=DEVICE, dtype="float32", backend="gpu", kv_cache_memory=1 << 22,
               max_num_batched_tokens=32, progress=False, **options)


def _greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


NEAR_TIE = 1e-2  # top-2 logits closer than this: float32 sums in another order may pick either


def _assert_transformers_greedy(reference, prompt: list[int], tokens: list[int]) -> None:
    """`tokens` are transformers' greedy continuation of `prompt`, up to a near tie: where the two
    differ, the reference's top two logits must be within NEAR_TIE and ours one of them (a random
    model's logits tie now and then; cuBLAS and the Triton kernels sum in other orders than the
    CPU). Past that token the continuations diverge, so the comparison stops there."""
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(tokens), do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    expected = out.sequences[0, len(prompt):].tolist()
    for i, (ours, theirs) in enumerate(zip(tokens, expected)):
        if ours != theirs:
            scores = out.scores[i][0].float()
            assert scores[theirs] - scores[ours] < NEAR_TIE, (i, tokens, expected)
            return
    assert tokens == expected


# One layer where a family's layers are all alike (the interpreter runs each layer's kernels: half the
# cost; gemma2's one layer a sliding one); gemma3 keeps two (a sliding and a global layer, each with its
# RoPE), which also index the second layer's KV cache, as the pipeline split below does
ONE_LAYER = {arch: {"num_hidden_layers": 1}
             for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "qwen2_moe")}


# slow under the interpreter: of the mixtures of experts one (with a shared expert); smollm3's NoPE layers
# are the RoPE kernel on a table of cos 1, sin 0 (tested on the CPU)
@pytest.mark.parametrize("arch", tuple(a for a in ARCHITECTURES if a != "smollm3") + ("qwen2_moe",))
def test_greedy_output_matches_transformers(tmp_path, arch):
    """Prompts chunked across steps (budget 32), a shared prefix served from the prefix cache,
    decodes batched with prefills: every token as transformers' generate picks it (up to a near tie)."""
    folder = make_hf_model(tmp_path / arch, arch, **ONE_LAYER.get(arch, {}))
    reference = load_hf_reference(folder).to(DEVICE)
    prompts = _prompts(4, seed=1)
    prompts.append(prompts[0] + [5, 6, 7])  # its first blocks come from the prefix cache
    for prompt, tokens in zip(prompts, _greedy(_llm(folder), prompts, 6)):  # (decode steps: the interpreter's cost)
        _assert_transformers_greedy(reference, prompt, tokens)


def test_sliding_window_past_the_window_matches_transformers(tmp_path):
    """mistral with an 8-token window, prompts and generations longer than it (prefill chunks whose
    windows start past whole tiles, split decode over the window only)."""
    folder = make_hf_model(tmp_path / "mistral", "mistral", sliding_window=8, **ONE_LAYER["mistral"])
    reference = load_hf_reference(folder).to(DEVICE)
    prompts = _prompts(3, seed=2, shortest=10)
    for prompt, tokens in zip(prompts, _greedy(_llm(folder), prompts, 12)):
        _assert_transformers_greedy(reference, prompt, tokens)


# (tests/models.py's layouts cut to one state layer each: the interpreter runs a layer's kernels in seconds)
HYBRID_LAYERS = {"qwen3_5": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
                 "nemotron_h": {"layers_block_type": ["mamba", "attention", "moe"]}}


@pytest.mark.parametrize("arch", HYBRID_LAYERS)
def test_hybrid_model_matches_transformers(tmp_path, arch):
    """State layers on the Triton kernels (hearth/triton_kernels/state_ops.py): Gated DeltaNet (qwen3_5) and
    Mamba2 (nemotron_h), each with its convolution. Three prompts at once: one over the token budget (its
    states carried across two chunks), one of one token (a decode row from a zero state); greedy tokens and
    top-5 logprobs of each step as transformers'. qwen3_5's decodes run the decode graphs' buffers (three
    rows in the bucket of 4: the padding row on state slot 0, which a prompt owns), nemotron_h's (experts)
    the eager path."""
    from test_hybrid_models import check_greedy_with_top5, transformers_greedy_with_top5

    folder = make_hf_model(tmp_path / arch, arch, **HYBRID_LAYERS[arch])
    prompts = [_prompts(1, seed=3, shortest=40)[0], [5, 6, 7, 8, 9], [11]]
    llm = _llm(folder)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_greedy_with_top5(outputs, transformers_greedy_with_top5(folder, prompts, 3))
    graphs = llm.engine.model.backend_state.get("decode_graphs")
    assert (graphs is not None) == (arch == "qwen3_5")
    if graphs is not None:  # the last decode step's buffers: three rows' slots, then the padding row's 0
        slots = graphs.inputs.field("state_slots", 4).tolist()
        assert len(set(slots[:3])) == 3 and 0 in slots[:3] and slots[3] == 0
        # the eager run before a capture (on a GPU) leaves the states as the replay must find them
        states = {name: t.clone() for name, t in llm.engine.runner.state_tensors().items()}
        graphs.warm_up(4, None)
        assert all(torch.equal(states[name], t) for name, t in llm.engine.runner.state_tensors().items())


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))


def test_decode_graphs_match_the_eager_path(tmp_path):
    """Batches of every bucket size and the sizes between (and past the largest bucket, which run
    eagerly): the graph runner's padded static buffers give the eager path's tokens."""
    folder = make_hf_model(tmp_path / "llama", "llama", **ONE_LAYER["llama"])
    graphs, eager = _llm(folder), _llm(folder)
    graphs.engine.runner.backend.max_graph_batch = 4  # buckets 1, 2, 4 (8 ran 2.5x the sequences under the interpreter)
    eager.engine.runner.backend.max_graph_batch = 0  # never a graph
    for size in (1, 3, 5):  # a bucket, between buckets (padded to the largest, 4), past the largest
        prompts = _prompts(size, seed=size, longest=20)
        assert _greedy(graphs, prompts, 4) == _greedy(eager, prompts, 4), f"batch of {size}"
    runner = graphs.engine.model.backend_state["decode_graphs"]
    assert runner.capture == (DEVICE == "cuda")
    if runner.capture:
        assert set(runner.graphs) == {(size, ("greedy", False)) for size in (1, 4)}  # 1 and 3 (padded); 5 eager
    assert "decode_graphs" not in eager.engine.model.backend_state
    # greedy rows beside random ones (the random heads captured, on a GPU): the greedy rows' tokens
    mixed = [SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0.7, top_k=5, max_tokens=4),
             SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=1.0, max_tokens=4)]
    prompts = _prompts(4, seed=4, longest=20)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, mixed, use_tqdm=False)] for llm in (graphs, eager)]
    assert tokens[0][::2] == tokens[1][::2]
    if runner.capture:
        assert (4, ("filtered", True)) in runner.graphs


def test_draws_in_the_decode_step_match_the_eager_sampler(tmp_path):
    """Decode steps whose draws run inside the step (hearth/engine/step_sampling.py: greedy rows,
    temperature, top-k / top-p / min-p): the eager sampler's tokens. Random rows draw with the
    global RNG, seeded alike for both engines; the batches are whole buckets (1, 2, 4), so both
    draw the same noise (a padded bucket's padding rows draw noise too: there the streams part).
    A seeded request draws with its own generator, in the eager sampler."""
    folder = make_hf_model(tmp_path / "llama", "llama", **ONE_LAYER["llama"])
    in_step, eager = _llm(folder), _llm(folder)
    in_step.engine.runner.backend.use_cuda_graphs = False  # (a GPU's graph replays its own RNG offsets)
    eager.engine.runner.backend.max_graph_batch = 0  # no graphs: every step the eager sampler's
    backend, replays = in_step.engine.runner.backend, []
    run = backend.decode_and_sample
    backend.decode_and_sample = lambda *args: replays.append(args[-1].key) or run(*args)
    greedy, plain = SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=1.0, max_tokens=4)
    filtered = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, max_tokens=4)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=4)
    batches = [[plain], [filtered, greedy], [greedy, plain, plain, plain], [seeded, plain]]
    for i, params in enumerate(batches):
        prompts = _prompts(len(params), seed=10 + i, longest=12)
        tokens = []
        for llm in (in_step, eager):
            torch.manual_seed(i)
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert tokens[0] == tokens[1], f"batch {i}"
    # (the greedy head: test_decode_graphs_match_the_eager_path)
    assert set(replays) == {("temperature", False), ("filtered", True), ("temperature", True)}
    assert len(replays) == 3 * 3  # 3 decode steps of the first three batches; none with the seeded request


@pytest.mark.parametrize("arch,out_type", [("llama", "q8_0"), ("llama", "q4_0"), ("qwen3_moe", "q4_0")])
def test_gguf_weights_stay_quantized_and_decode_as_the_reference(tmp_path, monkeypatch, arch, out_type):
    """A GGUF file's matrices become TritonQuantLinear (the blocks kept, about the file's bytes);
    greedy tokens equal the reference backend's on the same file, there dequantized (the exact path,
    tested against gguf's dequantizer; the cpu backend's kernels round activations to int8)."""
    from hearth.loading.convert import convert_hf_to_gguf
    from hearth.quant import kernels
    from hearth.backend.gpu_linear import TritonQuantLinear

    fewer_experts = {"num_experts": 4} if arch == "qwen3_moe" else {}  # the interpreter is slow
    folder = make_hf_model(tmp_path / arch, arch, intermediate_size=128, num_hidden_layers=1,  # whole 32-value blocks
                           **fewer_experts)
    path = convert_hf_to_gguf(folder, tmp_path / f"{arch}-{out_type}.gguf", out_type, progress=False)
    ours = _llm(path)
    monkeypatch.setattr(kernels, "extension", lambda: None)
    reference = LLM(path, device=DEVICE, dtype="float32", backend="reference", kv_cache_memory=1 << 22,
                    max_num_batched_tokens=32, progress=False)
    quantized = [m for m in ours.engine.model.modules() if isinstance(m, TritonQuantLinear)]
    assert len(quantized) >= 4  # q/k/v, o, gate/up, down of the layer (each expert's, in an MoE)
    prompts = _prompts(3, seed=7, longest=24)
    assert _greedy(ours, prompts, 3) == _greedy(reference, prompts, 3)  # a prefill, two decode steps


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_a_model_split_over_two_processes_gives_one_process_greedy_tokens(tmp_path, split):
    """Two tensor-parallel ranks (vocabulary rows 160 and 161 a rank) or two pipeline stages, each
    running the gpu backend's kernels, eagerly: one process's tokens. With one GPU both ranks share
    it (gloo: all-reduces and broadcasts of CUDA tensors, gathers and sends through host memory),
    with two NCCL; without a GPU, Triton's interpreter on CPU tensors (gloo)."""
    layers = 2 if "pipeline_parallel_size" in split else 1  # a layer a stage
    folder = make_hf_model(tmp_path / "llama", "llama", vocab_size=321, num_hidden_layers=layers)
    prompts = _prompts(2, seed=3, longest=12)
    split_llm = _llm(folder, **split)
    try:
        assert _greedy(split_llm, prompts, 4) == _greedy(_llm(folder), prompts, 4)
    finally:
        split_llm.engine.close()


def test_sleep_level_1_moves_the_weights_out_and_back_and_level_2_lets_the_engine_go(tmp_path):
    """Level 1 (LLMEngine.sleep, vLLM's): every weight and buffer copied to host RAM (pinned on a GPU) and the
    device's copies let go, the KV cache's memory given back, the decode graphs dropped; the next step wakes
    the engine, which decodes transformers' greedy tokens from the weights moved back. (A q8_0 GGUF's
    TritonQuantLinear, rebound by the same Module._apply as .to(), passes too, at 12 CPU-s a generate under
    the interpreter: too slow here.) Level 2 drops the engine: once it is, nothing holds its model."""
    folder = make_hf_model(tmp_path / "llama", "llama")
    llm = _llm(folder)
    engine, runner = llm.engine, llm.engine.runner
    prompt = _prompts(1, seed=5, shortest=8, longest=8)[0]
    before = _greedy(llm, [prompt], 2)[0]  # a prefill and a decode step (the decode graphs' buffers)
    assert "decode_graphs" in engine.model.backend_state
    weights = {n: (t.untyped_storage().data_ptr(), t.numel() * t.element_size())
               for n, t in [*runner.model.named_parameters(), *runner.model.named_buffers()]}
    kv_bytes = sum(t.numel() * t.element_size() for t, _ in runner._cache_tensors())
    assert engine.sleep() == kv_bytes + sum(nbytes for _, nbytes in weights.values()) and runner.asleep
    moved = dict([*runner.model.named_parameters(), *runner.model.named_buffers()])
    assert all(moved[n].untyped_storage().data_ptr() != ptr for n, (ptr, _) in weights.items())  # copies
    assert all(t.device.type == "cpu" and t.is_pinned() == (DEVICE == "cuda") for t in moved.values())
    assert "decode_graphs" not in engine.model.backend_state
    if DEVICE == "cpu":  # the cache's pages given back: they read as zeros
        assert all(not t.any() for t, _ in runner._cache_tensors())
    else:  # its storages freed, the tensors kept
        assert all(t.untyped_storage().nbytes() == 0 for t, _ in runner._cache_tensors())
    after = _greedy(llm, [prompt], 2)[0]  # the step wakes it
    assert not runner.asleep and after == before
    assert all(t.device.type == DEVICE for t in runner.model.parameters())
    _assert_transformers_greedy(load_hf_reference(folder).to(DEVICE), prompt, after)
    model = weakref.ref(runner.model)
    del llm, engine, runner, moved
    gc.collect()
    assert model() is None


def test_freed_storages_come_back_zeroed_under_the_same_tensors():
    """A GPU's KV cache in a level-1 sleep (kv_format.free_storages, restore_storages), here on CPU tensors
    torch allocated as it does a GPU's: each storage freed once however many layers' views share it, the
    tensor objects and views kept, and given back zero-filled (unused slots must read as zeros)."""
    from hearth.kv_format import free_storages, restore_storages

    layout = torch.ones(4, 3, 2)  # one allocation for two layers' K and V
    caches = [layout[0], layout[1], layout[2], layout[3]]
    codes = torch.ones(5, 2, dtype=torch.int8)
    freed = free_storages([*caches, codes])
    assert sorted(nbytes for _, nbytes in freed) == [10, 4 * 3 * 2 * 4]
    assert layout.untyped_storage().nbytes() == 0 and codes.untyped_storage().nbytes() == 0
    restore_storages(freed)
    assert not layout.any() and not codes.any() and layout.untyped_storage().nbytes() == 96
    caches[2][1, 0] = 7  # the views still share the allocation
    assert layout[2, 1, 0] == 7
