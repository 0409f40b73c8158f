"""SmolLM2-135M-Instruct, the default model, against llama.cpp's own outputs on the same GGUF
(../shared/data/models/smollm2-135m-instruct/llamacpp_reference.json, llama-cpp-python 0.3.36)."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hearth.cli import main
from hearth.engine.runner import BatchEntry, ModelRunner
from hearth.loading.loader import LoadedModel, load_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct"
GGUF = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = pytest.mark.skipif(not GGUF.exists(), reason=f"reference data not found: {DATA}")


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads((DATA / "llamacpp_reference.json").read_text())


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(GGUF, progress=False)


def test_tokenizations_equal_llama_cpp(smollm2, reference):
    # llama.cpp's tokenize(text, add_bos=False, special=True): special tokens in the text parsed
    for case in reference["tokenize"]:
        assert smollm2.tokenizer.encode(case["text"], add_special_tokens=False, parse_special=True) == case["ids"], \
            case["text"]


def next_token_logprobs(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """log p(next token | ids[:i+1]) at every position i: [len(ids), vocab], through the paged runner."""
    block_size = 16
    num_blocks = -(-len(ids) // block_size)
    runner = ModelRunner(loaded.model, num_blocks, block_size, torch.device("cpu"), loaded.model.dtype)
    with torch.no_grad():
        hidden, _ = runner.forward([BatchEntry(ids, 0, list(range(num_blocks)))])
        return loaded.model.compute_logits(hidden).double().log_softmax(dim=-1)


def test_next_token_distributions_match_llama_cpp(smollm2, reference):
    """Over every position of both windows: mean KL(llama.cpp || hearth) <= 0.005 on llama.cpp's
    top 10 plus one bucket for the rest of the mass, and the same most likely token >= 96% of the time."""
    divergences, agreements = [], []
    for window in reference["teacher_forced"]:
        logprobs = next_token_logprobs(smollm2, window["ids"])
        assert len(window["topk"]) == len(window["ids"])
        for position, top in zip(logprobs, window["topk"]):
            ids = torch.tensor([token for token, _ in top])
            p = torch.tensor([lp for _, lp in top], dtype=torch.float64).exp()
            q = position[ids].exp()
            p = torch.cat([p, (1 - p.sum()).clamp_min(0).reshape(1)])
            q = torch.cat([q, (1 - q.sum()).clamp_min(1e-300).reshape(1)])
            present = p > 0
            divergences.append((p[present] * (p[present] / q[present]).log()).sum().item())
            agreements.append(position.argmax().item() == top[0][0])
    mean_kl = math.fsum(divergences) / len(divergences)
    top1 = sum(agreements) / len(agreements)
    assert mean_kl <= 0.005 and top1 >= 0.96, f"mean KL {mean_kl:.4f}, top-1 agreement {top1:.1%}"


def test_chat_knows_the_capital_of_france(monkeypatch, capsys):
    """Greedy, with a plain system message: after SmolLM's default one the reply's first token is
    a 0.03-nat tie between "The" and "L" (then "L'Étoile, ..."), decided by rounding; after this one
    "The" leads by 0.55 nats (docs/default-model.md, Samples)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\n"))
    argv = ["chat", str(GGUF), "--system", "You are a helpful AI assistant.", "--temperature", "0",
            "--max-tokens", "32", "--kv-cache-memory", "64MiB"]
    assert main(argv) == 0
    assert "Paris" in capsys.readouterr().out


def repeat_prompt(tokenizer, first: int, lines: int) -> str:
    """A chat asking to repeat `lines` lines of json/decoder.py from line `first`: most of the reply is a copy."""
    code = "\n".join((DATA / "text-json-decoder.py.txt").read_text().splitlines()[first : first + lines])
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this Python code exactly:\n\n```python\n{code}\n```"}], True)


@pytest.mark.slow
def test_greedy_speculation_keeps_plain_decodings_tokens():
    """Asked to repeat a code block, SmolLM2 copies most of it: prompt lookup (every guess it finds)
    and lookahead verify 1 to 9 rows a step. Their greedy tokens are plain decoding's, token for
    token: on a real model two tokens are often nearly tied, so a row's arithmetic must not depend
    on how many rows its step verifies."""
    from hearth import LLM, SamplingParams

    plain = LLM(str(GGUF), kv_cache_memory=64 << 20, progress=False)
    prompt = repeat_prompt(plain.get_tokenizer(), 0, 24)
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    expected = plain.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    for options in ({"speculative_method": "ngram", "speculative_adaptive": False}, {"speculative_method": "lookahead"}):
        llm = LLM(str(GGUF), kv_cache_memory=64 << 20, progress=False, **options)
        assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected, options


@pytest.mark.slow
def test_greedy_speculation_in_a_batch_keeps_plain_decodings_tokens():
    """Eight requests at once with a small token budget: prompts are cut into chunks while the first
    ones decode and guess. Guesses take only the budget the chunks leave, so the chunks, and the
    greedy tokens, are plain decoding's."""
    from hearth import LLM, SamplingParams

    options = dict(kv_cache_memory=64 << 20, max_num_batched_tokens=256, progress=False)
    plain = LLM(str(GGUF), **options)
    prompts = [repeat_prompt(plain.get_tokenizer(), 4 * i, 12) for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    ngram = LLM(str(GGUF), speculative_method="ngram", speculative_adaptive=False, **options)
    assert [o.outputs[0].token_ids for o in ngram.generate(prompts, greedy, use_tqdm=False)] == expected


@pytest.mark.slow
def test_greedy_token_trees_keep_plain_decodings_tokens():
    """Token trees (prompt lookup's three branches; lookahead as published): a kept branch other than a
    tree's first reads its ancestors' K/V from slots apart from their positions, and its rows must sum
    their attention in position order to be plain decoding's bit for bit. On this prompt (the repeat
    task of benchmarks/speculative.py, renaming `pos` to `index`) prompt lookup's trees parted from
    plain decoding at token 84 while the cpu attention kernel summed by slot."""
    from hearth import LLM, SamplingParams

    plain = LLM(str(GGUF), kv_cache_memory=64 << 20, progress=False)
    text = (DATA / "text-json-decoder.py.txt").read_text()
    code = "\n".join(text[text.index("class JSONDecodeError"):].splitlines()[:24])
    ask = f"Repeat this Python code exactly, but rename the variable `pos` to `index`:\n\n```python\n{code}\n```"
    tokenizer = plain.get_tokenizer()
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": ask}], True),
                              add_special_tokens=False)
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    expected = plain.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    for options in ({"speculative_method": "ngram", "speculative_tree_width": 3, "speculative_adaptive": False},
                    {"speculative_method": "lookahead", "lookahead_mode": "full"}):
        llm = LLM(str(GGUF), kv_cache_memory=64 << 20, progress=False, **options)
        assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected, options
        assert llm.engine.spec_decode_totals.num_accepted_tokens > 0
