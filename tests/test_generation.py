"""Decoding strategies through the whole engine: seeds, stops, logprobs, n / best_of, beam search."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth import LLM, BeamSearchParams, SamplingParams
from models import VOCAB_SIZE, load_hf_reference, make_draft_model, make_hf_model

EOS = 1  # tests/models.py: "</s>"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = make_hf_model(tmp_path_factory.mktemp("generation") / "llama", "llama")
    # make EOS a frequent choice so that beams and samples end at different lengths
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][EOS] *= 3.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=["plain", "ngram", "lookahead", "draft", "ngram tree", "draft tree"])
def llm(folder, request, tmp_path_factory):
    """Every test runs without speculation, with prompt lookup (guessing from one-token matches),
    lookahead, and with a draft model (the target with noise on its weights); prompt lookup and
    the draft also with token trees of three branches."""
    method, _, tree = request.param.partition(" ")
    trees = dict(speculative_tree_width=3) if tree else {}
    if method == "plain":
        return LLM(folder, progress=False)
    if method in ("ngram", "lookahead"):
        lookup = dict(prompt_lookup_min=1) if method == "ngram" else {}
        return LLM(folder, progress=False, speculative_method=method, speculative_adaptive=False, **lookup, **trees)
    draft = make_draft_model(folder, tmp_path_factory.mktemp("generation") / "draft", noise=0.2)
    return LLM(folder, progress=False, speculative_method="draft", speculative_model=draft, speculative_adaptive=False,
               **trees)


@pytest.fixture(scope="module")
def reference(folder):
    return load_hf_reference(folder)


def prompts(count: int, seed: int, shortest: int = 3, longest: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(shortest, longest))] for _ in range(count)]


def test_seeded_requests_ignore_batch_composition_and_order(llm):
    target = prompts(1, seed=1)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = prompts(9, seed=2)
    mixed_params = [SamplingParams(temperature=0.7, max_tokens=12, seed=s) for s in range(9)]
    batch = llm.generate(others[:4] + [target] + others[4:], mixed_params[:4] + [params] + mixed_params[4:],
                         use_tqdm=False)
    reversed_batch = llm.generate([target] + others[::-1], [params] + mixed_params[::-1], use_tqdm=False)
    assert batch[4].outputs[0].token_ids == alone
    assert reversed_batch[0].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    draws = {tuple(o.outputs[0].token_ids) for o in llm.generate([target] * 4, unseeded, use_tqdm=False)}
    assert len(draws) > 1  # unseeded requests do differ


def test_logprobs_equal_transformers(llm, reference):
    prompt = prompts(1, seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    sequence = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([sequence])).logits[0].float(), dim=-1)
    for position, entry in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + position]
        token = out.outputs[0].token_ids[position]
        assert abs(entry[token] - row[token].item()) < 1e-4
        top = torch.topk(row, 3)
        assert set(top.indices.tolist()) <= set(entry)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert abs(entry[prompt[position]] - ref[position - 1, prompt[position]].item()) < 1e-4
        assert set(torch.topk(ref[position - 1], 2).indices.tolist()) <= set(entry)
    total = sum(e[t] for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids))
    assert abs(out.outputs[0].cumulative_logprob - total) < 1e-6


def test_scoring_with_max_tokens_zero(llm):
    prompt = prompts(1, seed=4)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert len(out.prompt_logprobs) == len(prompt)


def test_stop_strings_and_stop_tokens(llm):
    prompt = "def fibonacci(n):"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    # a stop string spanning a token boundary: the end of token 3's text and the start of token 4's
    boundary = len(tokenizer.decode(ids[:4]))
    stop = text[boundary - 2 : boundary + 2]
    assert len(stop) == 4 and text.find(stop) == boundary - 2
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: boundary - 2] and out.finish_reason == "stop" and out.stop_reason == stop
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text == text[: boundary + 2]
    # a stop token id ends the output, kept in token_ids but not in the text
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ids[5]])
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    first = ids.index(ids[5])
    assert out.token_ids == ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == ids[5]
    assert out.text == tokenizer.decode(ids[:first])
    # min_tokens masks the stop token until enough tokens exist
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ids[5]], min_tokens=first + 3)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 3 and ids[5] not in out.token_ids[: first + 2]


def test_eos_ends_generation_unless_ignored(llm, reference):
    found = None
    for prompt in prompts(20, seed=5):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
        if out.finish_reason == "stop":
            found = (prompt, out)
            break
    assert found is not None, "no prompt reached EOS"
    prompt, out = found
    assert out.token_ids[-1] == EOS and out.stop_reason is None
    ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert len(ignored[0].outputs[0].token_ids) == 16 and ignored[0].outputs[0].finish_reason == "length"


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = prompts(1, seed=6, shortest=64, longest=64)[0]
    hits_before = llm.engine.block_manager.prefix_cache_hits
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # samples 1..3 found the 48 tokens of 3 full blocks (at least one token is always computed)
    assert llm.engine.block_manager.prefix_cache_hits - hits_before >= 3 * 48
    assert llm.engine.block_manager.check_all_free()


def test_best_of_keeps_the_most_likely(llm):
    prompt = prompts(1, seed=8)[0]
    params = SamplingParams(n=5, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    every = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    best = llm.generate([prompt], SamplingParams(n=2, best_of=5, temperature=1.0, seed=11, max_tokens=8,
                                                 ignore_eos=True), use_tqdm=False)[0].outputs
    expected = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in expected]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -1.0])
def test_beam_search_equals_transformers(llm, reference, length_penalty):
    batch = prompts(5, seed=9, longest=20)
    outputs = llm.beam_search(batch, BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty))
    eos_endings = 0
    for prompt, out in zip(batch, outputs):
        with torch.no_grad():
            ref = reference.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                num_beams=3, num_return_sequences=3, max_new_tokens=8, do_sample=False,
                length_penalty=length_penalty, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            )
        expected = []
        for sequence in ref.sequences[:, len(prompt):].tolist():
            expected.append(sequence[: sequence.index(EOS) + 1] if EOS in sequence else sequence)
        assert [s.token_ids for s in out.sequences] == expected
        assert [s.score for s in out.sequences] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
        eos_endings += sum(s.finish_reason == "stop" for s in out.sequences)
    if length_penalty in (0.0, -1.0):
        assert eos_endings > 0  # the penalty really decided between lengths
    assert llm.engine.block_manager.check_all_free()
