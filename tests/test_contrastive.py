"""Contrastive decoding (Li et al. 2023) against a direct computation from the two models' logits,
each computed by transformers: greedy outputs token for token, and the distribution of draws."""

from __future__ import annotations

import json
import random

import pytest
import torch
from scipy import stats

from hearth import LLM, SamplingParams
from hearth.errors import RequestError
from models import VOCAB_SIZE, load_hf_reference, make_hf_model

P_VALUE = 1e-3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("contrastive")
    # the amateur: another family and size, the same vocabulary (tests/models.py's tokenizer)
    return make_hf_model(root / "expert", "llama"), make_hf_model(root / "amateur", "qwen2", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def references(folders):
    return tuple(load_hf_reference(f) for f in folders)


@pytest.fixture(scope="module")
def llm(folders):
    return LLM(folders[0], progress=False, contrastive_model=folders[1], kv_cache_memory=1 << 22)


def contrastive_scores(references, token_ids: list[int], alpha: float, weight: float) -> torch.Tensor:
    """log p_expert - weight * log p_amateur where p_expert >= alpha * max p_expert, -inf elsewhere [V]."""
    expert, amateur = references
    with torch.no_grad():
        log_p = expert(torch.tensor([token_ids])).logits[0, -1].double().log_softmax(-1)
        log_q = amateur(torch.tensor([token_ids])).logits[0, -1].double().log_softmax(-1)
    plausible = log_p.exp() >= alpha * log_p.exp().max()
    return torch.where(plausible, log_p - weight * log_q, float("-inf"))


def test_greedy_equals_the_direct_computation(llm, references):
    """Requests with different weights and cut-offs, and a plain one, in one batch."""
    rng = random.Random(0)
    settings = [(1.0, 0.1), (0.5, 0.0), (2.0, 0.3), (1.0, 0.05), (0.0, 0.1)]  # (weight, alpha); 0: plain
    prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(3, 20))] for _ in settings]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, contrastive_weight=w, contrastive_alpha=a)
              for w, a in settings]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, (weight, alpha), out in zip(prompts, settings, outputs):
        ids = list(prompt)
        for _ in range(10):
            ids.append(int(contrastive_scores(references, ids, alpha, weight).argmax()))
        assert out.outputs[0].token_ids == ids[len(prompt):], (weight, alpha)
    assert llm.engine.block_manager.check_all_free() and llm.engine.runner.amateur.block_manager.check_all_free()


def test_draws_follow_the_contrastive_distribution(llm, references):
    """First tokens drawn at temperature 0.8: softmax(scores / 0.8), chi-square over 3,000 draws."""
    prompt = [5, 17, 33, 90, 4, 61]
    weight, alpha, temperature, draws = 1.0, 0.02, 0.8, 3000
    params = SamplingParams(temperature=temperature, max_tokens=1, contrastive_weight=weight, contrastive_alpha=alpha)
    tokens = [o.outputs[0].token_ids[0] for o in llm.generate([prompt] * draws, params, use_tqdm=False)]
    p = torch.softmax(contrastive_scores(references, prompt, alpha, weight) / temperature, dim=-1)
    observed = torch.bincount(torch.tensor(tokens), minlength=VOCAB_SIZE).double()
    assert observed[p == 0].sum() == 0  # nothing outside the plausible set
    frequent = p * draws >= 5
    assert frequent.sum() >= 3  # a distribution worth testing
    expected = torch.cat([p[frequent] * draws, (p[~frequent].sum() * draws).reshape(1)])
    counts = torch.cat([observed[frequent], observed[~frequent].sum().reshape(1)])
    assert stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue > P_VALUE


def test_a_request_without_the_amateur_is_refused(folders):
    plain = LLM(folders[0], progress=False)
    with pytest.raises(RequestError, match="contrastive_model"):
        plain.generate([[5, 6]], SamplingParams(contrastive_weight=1.0), use_tqdm=False)
    with pytest.raises(ValueError, match="contrastive_alpha"):
        SamplingParams(contrastive_alpha=1.5)
    with pytest.raises(ValueError, match="contrastive_weight"):
        SamplingParams(contrastive_weight=-1.0)


def test_cli_and_server_fields(folders, llm, capsys):
    """`hearth generate --contrastive-model ... --contrastive-weight` gives the API's output, and the
    server's request fields reach SamplingParams."""
    from hearth.cli import main
    from hearth.server.protocol import CompletionRequest

    prompt, weight, alpha = "def fibonacci(n):", 1.5, 0.2
    params = SamplingParams(temperature=0, max_tokens=8, contrastive_weight=weight, contrastive_alpha=alpha)
    expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    argv = ["generate", folders[0], "--prompt", prompt, "--max-tokens", 8, "--temperature", 0, "--json",
            "--contrastive-model", folders[1], "--contrastive-weight", weight, "--contrastive-alpha", alpha]
    assert main([str(a) for a in argv]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected
    request = CompletionRequest(model="m", prompt="x", contrastive_weight=weight, contrastive_alpha=alpha)
    sampling = request.sampling_params(8, None, None)
    assert (sampling.contrastive_weight, sampling.contrastive_alpha) == (weight, alpha)
