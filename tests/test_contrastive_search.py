"""Contrastive search (Su et al. 2022) against the paper's formula written here, on transformers'
hidden states and logits of the same random-weight Llama (fp32): token for token, alone and in a
batch with plain requests, on the reference and the cpu backend; alone on the gpu backend."""

from __future__ import annotations

import random

import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.errors import RequestError
from models import VOCAB_SIZE, load_hf_reference, make_hf_model

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("contrastive_search"), "llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def reference(folder):
    return load_hf_reference(folder)


def contrastive_search(model, prompt: list[int], alpha: float, k: int, steps: int) -> list[int]:
    """The paper's eq. (2) at every step: of the k likeliest tokens v, the one of most
    (1 - alpha) p(v) - alpha max_j cos(h_v, h_j), h the last layer's output (transformers'
    hidden_states[-1]) at each position; each candidate run as the whole text followed by it."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            out = model(torch.tensor([ids]), output_hidden_states=True)
            context = out.hidden_states[-1][0]  # [t, H]
            probs, candidates = out.logits[0, -1].softmax(-1).topk(k)
            scores = []
            for p, v in zip(probs.tolist(), candidates.tolist()):
                h = model(torch.tensor([ids + [v]]), output_hidden_states=True).hidden_states[-1][0, -1]
                degeneration = max(torch.cosine_similarity(h, c, dim=0).item() for c in context)
                scores.append((1 - alpha) * p - alpha * degeneration)
            ids.append(candidates[scores.index(max(scores))].item())  # ties: the likelier candidate
    return ids[len(prompt):]


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(prompt):].tolist()


SETTINGS = [(0.6, 4), (0.3, 6), (0.9, 2)]  # (penalty_alpha, top_k); then two plain greedy requests


@pytest.fixture(scope="module")
def cases(reference):
    """The prompts and each one's expected tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(4, 20))] for _ in range(len(SETTINGS) + 2)]
    expected = [contrastive_search(reference, p, a, k, MAX_TOKENS) for p, (a, k) in zip(prompts, SETTINGS)]
    expected += [greedy(reference, p, MAX_TOKENS) for p in prompts[len(SETTINGS):]]
    assert any(e != greedy(reference, p, MAX_TOKENS) for e, p in zip(expected, prompts))  # the search chose otherwise
    return prompts, expected


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_equals_the_formula_alone_and_batched(folder, cases, backend):
    prompts, expected = cases
    settings = SETTINGS
    llm = LLM(folder, progress=False, backend=backend, kv_cache_memory=1 << 22)
    params = [SamplingParams(penalty_alpha=a, top_k=k, max_tokens=MAX_TOKENS, ignore_eos=True) for a, k in settings]
    params += [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 2
    alone = llm.generate(prompts[0], params[0], use_tqdm=False)[0].outputs[0].token_ids
    assert alone == expected[0]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert batched == expected
    assert llm.engine.block_manager.check_all_free() and not llm.engine.runner.hidden_states


def test_equals_the_formula_on_the_gpu_backend(folder, cases):
    """The gpu backend (its Triton kernels interpreted on the CPU without a GPU), one request's first tokens: the
    candidates, sibling rows of a token tree, through the prefill kernel's tree masks."""
    prompts, expected = cases
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(folder, progress=False, backend="gpu", device=device, dtype="float32", kv_cache_memory=1 << 22)
    alpha, k = SETTINGS[0]
    params = SamplingParams(penalty_alpha=alpha, top_k=k, max_tokens=4, ignore_eos=True)  # (the interpreter's cost)
    assert llm.generate(prompts[0], params, use_tqdm=False)[0].outputs[0].token_ids == expected[0][:4]


def test_bad_settings_are_refused(folder):
    for bad in (dict(penalty_alpha=0.6), dict(penalty_alpha=0.6, top_k=17), dict(penalty_alpha=1.5, top_k=4),
                dict(penalty_alpha=0.6, top_k=4, n=2)):
        with pytest.raises(RequestError):
            SamplingParams(**bad)
