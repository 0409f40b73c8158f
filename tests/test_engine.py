"""The engine's greedy outputs are transformers' greedy `generate`, however requests are batched."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.errors import RequestError
from models import ARCHITECTURES, MOE_ARCHITECTURES, VOCAB_SIZE, load_hf_reference, make_draft_model, make_hf_model

MAX_TOKENS = 10
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 kv heads x head_dim 16 x fp32


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-models")
    return {arch: make_hf_model(root / arch, arch) for arch in ARCHITECTURES}


def random_prompts(count: int, seed: int, shortest: int = 2, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(shortest, longest))] for _ in range(count)]


def reference_greedy(folder: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """transformers' greedy continuations of each prompt. Kept per process for the folder's files as
    they are now: the matrices below ask again for the same prompts under each speculative method."""
    files = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(Path(folder).iterdir()))
    key = (str(folder), files, tuple(map(tuple, prompts)), max_tokens)
    if key not in _REFERENCE_GREEDY:
        _REFERENCE_GREEDY[key] = _transformers_greedy(folder, prompts, max_tokens)
    return [list(tokens) for tokens in _REFERENCE_GREEDY[key]]


_REFERENCE_GREEDY: dict[tuple, list[list[int]]] = {}


def _transformers_greedy(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = load_hf_reference(folder)
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    model.generation_config.pad_token_id = 0
    if model.config.model_type in BATCHED_REFERENCE:
        return _transformers_greedy_batched(model, prompts, max_tokens)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            outputs.append(ids[0, len(prompt):].tolist())
    return outputs


# model types whose left-padded batch gives the same greedy tokens as each prompt alone (every prompt set of
# this file and of test_families compared so, 2026-11-27); others (recurrent states, ...) go one by one
BATCHED_REFERENCE = (*ARCHITECTURES, "gemma3_text", *MOE_ARCHITECTURES, "phi3")


def _transformers_greedy_batched(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """All prompts in one generate call, left-padded and masked (a thirteenth of the CPU of one by one)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False)
    return out[:, width:].tolist()


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# The matrix below runs without speculation, with prompt lookup, lookahead and a draft model: greedy
# outputs must be transformers' either way. A match of one token makes guesses frequent on random
# prompts; the draft is the target with noise on its weights (most guesses right, some wrong); and
# every request guesses (no adapting), so that 32 requests at once still guess. "... tree": token
# trees of three branches (several matches; the draft's first guess and its two next best tokens).
# "early-exit": the model's first layer drafts (on the target's own KV cache). "lookahead full": lookahead
# as published (its 2-D window's rows and pool n-grams in one token tree).
SPECULATION = ("plain", "ngram", "lookahead", "draft", "ngram tree", "draft tree", "early-exit", "lookahead full")


@pytest.fixture(scope="module")
def speculation(model_folders, tmp_path_factory):
    """(spec, arch) -> the LLM options of that speculation for that architecture's model."""
    drafts = {}

    def options(spec: str, arch: str) -> dict:
        if spec.endswith(" tree"):
            return options(spec.removesuffix(" tree"), arch) | dict(speculative_tree_width=3)
        if spec == "plain":
            return {}
        if spec == "ngram":
            return dict(speculative_method="ngram", prompt_lookup_min=1, speculative_adaptive=False)
        if spec.startswith("lookahead"):  # "lookahead full": as published, a token tree
            return dict(speculative_method="lookahead", speculative_adaptive=False,
                        lookahead_mode=spec.removeprefix("lookahead").strip() or "chain")
        if spec == "early-exit":
            return dict(speculative_method="early-exit", exit_layer=1, speculative_adaptive=False)
        if arch not in drafts:
            drafts[arch] = make_draft_model(model_folders[arch], tmp_path_factory.mktemp("draft") / arch, noise=0.2)
        return dict(speculative_method="draft", speculative_model=drafts[arch], speculative_adaptive=False)

    return options


def check_speculated(llm, spec: str) -> None:
    """With speculation on, guesses were made and accepted (and rejected: test_rejected_guesses...)."""
    counts = llm.engine.spec_decode_totals
    if spec == "plain":
        assert counts.num_draft_tokens == 0
    else:
        assert 0 < counts.num_accepted_tokens <= counts.num_draft_tokens
    if spec.startswith("draft"):  # the draft's own cache is empty again too
        assert llm.engine.runner.draft.block_manager.check_all_free()


# the draft's path does not depend on the family: four of them (a sliding/soft-capped one, one without RoPE);
# token trees and early exit: a plain one and the sliding/soft-capped one (the window counted from a row's depth)
DRAFT_ARCHITECTURES = ("llama", "qwen3", "gemma2", "smollm3")
TREE_ARCHITECTURES = ("llama", "gemma2")


@pytest.mark.parametrize("arch,spec", [(arch, spec) for arch in ARCHITECTURES for spec in SPECULATION
                                       if spec in ("plain", "ngram", "lookahead")
                                       or (arch == "llama" if spec == "lookahead full"
                                           else arch in (TREE_ARCHITECTURES if spec.endswith((" tree", "early-exit"))
                                                         else DRAFT_ARCHITECTURES))])
def test_greedy_alone_and_32_at_once_match_transformers(model_folders, speculation, arch, spec):
    prompts = random_prompts(32, seed=ARCHITECTURES.index(arch))
    expected = reference_greedy(model_folders[arch], prompts)
    llm = LLM(model_folders[arch], max_num_batched_tokens=96, progress=False, **speculation(spec, arch))
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == expected
    alone = [llm.generate([p], greedy(), use_tqdm=False)[0] for p in prompts[:6]]
    assert token_ids(alone) == expected[:6]
    assert llm.engine.block_manager.check_all_free()
    check_speculated(llm, spec)


@pytest.mark.parametrize("spec", SPECULATION)
@pytest.mark.parametrize("chunked,budget", [(True, 8), (True, 17), (True, 2048), (False, 64)])
def test_chunked_prefill_on_and_off(model_folders, speculation, chunked, budget, spec):
    prompts = random_prompts(12, seed=7, longest=60)
    expected = reference_greedy(model_folders["llama"], prompts)
    llm = LLM(model_folders["llama"], max_num_batched_tokens=budget, enable_chunked_prefill=chunked, progress=False,
              **speculation(spec, "llama"))
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == expected
    check_speculated(llm, spec)


@pytest.mark.parametrize("spec", SPECULATION)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_on_and_off(model_folders, speculation, prefix_caching, spec):
    shared = random_prompts(1, seed=3, shortest=50, longest=50)[0]
    prompts = [shared + tail for tail in random_prompts(8, seed=4, shortest=1, longest=12)]
    expected = reference_greedy(model_folders["qwen2"], prompts)
    llm = LLM(model_folders["qwen2"], enable_prefix_caching=prefix_caching, progress=False,
              **speculation(spec, "qwen2"))
    first = llm.generate(prompts[:2], greedy(), use_tqdm=False)  # fills the cache
    rest = llm.generate(prompts[2:], greedy(), use_tqdm=False)  # shares its blocks
    assert token_ids(first + rest) == expected
    check_speculated(llm, spec)
    hits = llm.engine.block_manager.prefix_cache_hits
    if prefix_caching:
        assert hits >= 6 * 48 and all(o.num_cached_tokens >= 48 for o in rest)
    else:
        assert hits == 0


@pytest.mark.parametrize("spec", SPECULATION)
def test_preemption_under_a_small_kv_budget(model_folders, speculation, spec):
    prompts = random_prompts(16, seed=11, shortest=20, longest=40)
    expected = reference_greedy(model_folders["gemma"], prompts, max_tokens=24)
    # 14 blocks of 16 tokens: room for about 4 of the 16 requests at their full length
    llm = LLM(model_folders["gemma"], kv_cache_memory=14 * 16 * KV_BYTES_PER_TOKEN, progress=False,
              **speculation(spec, "gemma"))
    assert llm.engine.num_blocks == 14
    outputs = llm.generate(prompts, greedy(24), use_tqdm=False)
    assert token_ids(outputs) == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.engine.block_manager.check_all_free()
    check_speculated(llm, spec)


@pytest.mark.parametrize("spec", SPECULATION)
def test_every_block_free_after_finished_and_aborted_requests(model_folders, speculation, spec):
    llm = LLM(model_folders["llama"], max_num_batched_tokens=32, progress=False, **speculation(spec, "llama"))
    engine = llm.engine
    ids = [engine.add_request(None, p, greedy(30)) for p in random_prompts(10, seed=5)]
    for _ in range(3):
        engine.step()
    for request_id in ids[::3]:
        assert engine.abort_request(request_id)
    assert not engine.abort_request("no-such-request")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.check_all_free()
    assert engine.block_manager.usage == 0
    if spec.startswith("draft"):
        assert engine.runner.draft.block_manager.check_all_free()


def test_too_long_prompt_is_refused_and_others_still_served(model_folders):
    llm = LLM(model_folders["llama"], max_model_len=64, kv_cache_memory=64 * 16 * KV_BYTES_PER_TOKEN, progress=False)
    engine = llm.engine
    good = random_prompts(2, seed=9)
    expected = reference_greedy(model_folders["llama"], good)
    first = engine.add_request("a", good[0], greedy())
    with pytest.raises(RequestError, match="context window"):
        engine.add_request("too-long", list(range(65)), greedy())
    small = LLM(model_folders["llama"], kv_cache_memory=4 * 16 * KV_BYTES_PER_TOKEN, progress=False)
    with pytest.raises(RequestError, match="KV cache"):
        small.engine.add_request("too-big", list(range(100)), greedy())
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [], greedy())
    with pytest.raises(RequestError, match="integers in"):
        engine.add_request("bad-id", [VOCAB_SIZE + 5], greedy())
    with pytest.raises(RequestError, match="a string or a list of token ids, not float"):
        engine.add_request("bad-type", 3.5, greedy())
    engine.add_request("b", good[1], greedy())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert first == "a" and [done["a"], done["b"]] == expected


def test_string_prompts_chat_and_stream(model_folders):
    llm = LLM(model_folders["llama"], progress=False)
    tokenizer = llm.get_tokenizer()
    text = "def fibonacci(n):"
    prompt_ids = tokenizer.encode(text)
    expected = reference_greedy(model_folders["llama"], [prompt_ids])[0]
    out = llm.generate(text, greedy(), use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text == tokenizer.decode(expected)
    assert out.outputs[0].finish_reason == "length"
    assert out.metrics.first_token_time >= out.metrics.arrival_time
    streamed = [o.outputs[0].text for o in llm.stream(text, greedy())]
    assert len(streamed) == MAX_TOKENS and streamed[-1] == out.outputs[0].text
    assert all(b.startswith(a) for a, b in zip(streamed, streamed[1:]))
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, True), add_special_tokens=False)
    chat = llm.chat(messages, greedy(), use_tqdm=False)[0]
    assert chat.prompt_token_ids[-len(chat_ids):] == chat_ids
    assert chat.outputs[0].token_ids == reference_greedy(model_folders["llama"], [chat.prompt_token_ids])[0]
    with pytest.raises(RequestError, match="at least one message"):
        llm.render_chat([])


def test_vllm_prompt_dicts(model_folders):
    """vLLM's TextPrompt {"prompt": text} and TokensPrompt {"prompt_token_ids": ids}, alone, in a
    list and streamed, give transformers' greedy tokens for that text and those ids; a dict with
    anything else is refused with its keys named, and nothing stays queued."""
    llm = LLM(model_folders["llama"], progress=False)
    text = "def fibonacci(n):"
    ids = random_prompts(1, seed=12)[0]
    expected = reference_greedy(model_folders["llama"], [llm.get_tokenizer().encode(text), ids])
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected and outs[0].prompt == text
    assert llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)[0].outputs[0].token_ids == expected[1]
    assert list(llm.stream({"prompt": text}, greedy()))[-1].outputs[0].token_ids == expected[0]
    with pytest.raises(RequestError, match="multi_modal_data"):
        llm.generate([text, {"prompt": text, "multi_modal_data": {}}], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.check_all_free()


DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "stories260K"


def test_real_model_greedy_matches_published_output():
    if not DATA.exists():
        pytest.skip(f"reference data not found at {DATA}")
    cases = json.loads((DATA / "expected_greedy.json").read_text())["cases"]
    llm = LLM(DATA / "stories260K.gguf", progress=False)
    prompts, params = [], []
    for case in cases:
        n_prompt = len(llm.get_tokenizer().encode(case["prompt"])) if case["prompt"] else 1
        assert case["tokens"][:n_prompt] == (llm.get_tokenizer().encode(case["prompt"]) if case["prompt"] else [1])
        prompts.append(case["tokens"][:n_prompt])
        # run.c stops when it samples BOS (id 1)
        params.append(SamplingParams(temperature=0, max_tokens=len(case["tokens"]) - n_prompt, stop_token_ids=[1]))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for case, prompt, out in zip(cases, prompts, outputs):
        assert prompt + out.outputs[0].token_ids == case["tokens"]
        assert case["text"].endswith(out.outputs[0].text)  # the published text: prompt + completion


def test_one_sequence_cache_holds_a_full_context_prompt(model_folders):
    """With max_num_seqs 1 (hearth generate and chat) the default cache is one context long, and a
    prompt of the whole context is still served (its sampled token ends it: length)."""
    llm = LLM(model_folders["llama"], max_model_len=64, max_num_seqs=1, progress=False)
    assert 65 <= llm.engine.kv_cache_tokens <= 80
    out = llm.generate([list(range(64))], greedy(), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 1
    with pytest.raises(RequestError, match="context window"):
        llm.engine.add_request("too-long", list(range(65)), greedy())


def test_cpu_draws_in_the_decode_step_match_the_eager_sampler(tmp_path):
    """The cpu backend's plain decode steps draw by the step's head (Backend.decode_and_sample,
    hearth/engine/step_sampling.py) instead of the runner's sampler: greedy, temperature and
    filtered rows give the eager sampler's tokens with the global RNG seeded alike; a seeded
    request (its own generator) and a step asking for logprobs take the eager way."""
    folder = make_hf_model(tmp_path / "llama", "llama", num_hidden_layers=1)
    in_step, eager = (LLM(folder, dtype="float32", backend="cpu", kv_cache_memory=1 << 22, progress=False)
                      for _ in range(2))
    eager.engine.runner.backend.decode_and_sample = lambda *args: None  # (the base's: no such path)
    backend, heads = in_step.engine.runner.backend, []
    run = backend.decode_and_sample

    def traced(*args):  # the head of each step drawn by it
        out = run(*args)
        heads.append(None if out is None else args[-1].key)
        return out

    backend.decode_and_sample = traced
    greedy, plain = SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=1.0, max_tokens=4)
    filtered = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, max_tokens=4)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=4)
    batches = [[plain], [filtered, greedy], [greedy, plain, plain], [seeded, plain],
               [SamplingParams(temperature=0, max_tokens=4, logprobs=2)]]
    rng = random.Random(3)
    for i, params in enumerate(batches):
        prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(2, 12))] for _ in params]
        tokens = []
        for llm in (in_step, eager):
            torch.manual_seed(i)
            tokens.append([(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                           for o in llm.generate(prompts, params, use_tqdm=False)])
        assert tokens[0] == tokens[1], f"batch {i}"
    assert heads == [("temperature", False)] * 3 + [("filtered", True)] * 3 + [("temperature", True)] * 3


def test_cpu_greedy_decode_step_in_one_call_gives_the_modules_tokens_and_logprobs(tmp_path):
    """An all-greedy decode step of a model on the cpu backend's decode path (a q8_0 GGUF: its embedding, layers
    and LM head on the kernels) runs as one greedy pass (CpuBackend._greedy_step: embedding, layers, norm, LM head,
    argmax and log-probability in one kernel call): the tokens and log-probabilities of the modules' path, bit for
    bit, at batch 1 and 4."""
    from hearth.backend.cpu import cpu_kernels
    from hearth.loading.convert import convert_hf_to_gguf
    from hearth.quant import kernels

    if kernels.extension() is None or cpu_kernels() is None:
        pytest.skip("the C++ kernels could not be built here")
    folder = make_hf_model(tmp_path / "llama", "llama", intermediate_size=128)
    path = convert_hf_to_gguf(folder, tmp_path / "model.gguf", "q8_0", progress=False)
    one_call, modules = (LLM(path, progress=False) for _ in range(2))
    modules.engine.runner.backend._greedy_step = lambda *args: None
    backend, fused = one_call.engine.runner.backend, []
    step = backend._greedy_step
    backend._greedy_step = lambda *args: fused.append(step(*args)) or fused[-1]
    rng = random.Random(11)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for batch in (1, 4):
        prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(2, 12))] for _ in range(batch)]
        outputs = [[(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                    for o in llm.generate(prompts, greedy, use_tqdm=False)] for llm in (one_call, modules)]
        assert outputs[0] == outputs[1]
    assert len(fused) >= 20 and all(drawn is not None for drawn in fused)
