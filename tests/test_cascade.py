"""Cascades (hearth/engine/cascade.py): a request starts on a small model and moves to a large one after a token
the small model drew with a probability under the threshold.

The pair is the first-class case: two quantizations of one model's weights, the built-in model in Q2_K (small)
and Q8_0 (large), made with `hearth quantize`'s quantize_model. The references are each model alone: the small
model's greedy output with its logprobs says where a request must move (the first token, not the last, whose
probability is under T), and the large model's greedy continuation of the prompt and the small model's tokens
up to there is the rest of the output.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import httpx
import openai
import pytest

from hearth import LLM, SamplingParams
from hearth.cli import build_parser
from hearth.engine.async_engine import AsyncEngine
from hearth.errors import HearthError
from hearth.fleet.launch import serve
from hearth.server.app import build_app
from test_server import serving

BUILTIN = Path(__file__).resolve().parents[1] / "hearth" / "assets" / "default.gguf"
SMOLLM2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["Once upon a time", "The little dog", "Lily went to the park", "One day, a big", "Tom had a red ball",
           "The sun"]
N = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """(small, large): the built-in model quantized to Q2_K and to Q8_0."""
    from hearth.loading.quantize import quantize_model

    folder = tmp_path_factory.mktemp("cascade")
    for kind in ("q2_k", "q8_0"):
        quantize_model(BUILTIN, folder / f"{kind}.gguf", kind)
    return str(folder / "q2_k.gguf"), str(folder / "q8_0.gguf")


@pytest.fixture(scope="module")
def alone(pair) -> tuple[LLM, LLM]:
    return LLM(pair[0], progress=False), LLM(pair[1], progress=False)


def reference(small: LLM, prompts: list, n: int = N) -> list[tuple[list[int], list[int], list[float]]]:
    """Each prompt's ids, the small model's greedy tokens and each token's probability (from its logprobs)."""
    outputs = small.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0),
                             use_tqdm=False)
    return [(o.prompt_token_ids, o.outputs[0].token_ids,
             [math.exp(entry[t]) for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outputs]


@pytest.fixture(scope="module")
def small_reference(alone) -> list[tuple[list[int], list[int], list[float]]]:
    return reference(alone[0], PROMPTS)


def expected(alone, small_reference, threshold: float) -> list[tuple[list[int], int | None]]:
    """Each prompt's expected tokens and where it moves (None: it stays), from each model alone."""
    result = []
    for prompt_ids, tokens, probabilities in small_reference:
        # the last token ends the request (max_tokens): it moves nothing
        moved = next((i + 1 for i, p in enumerate(probabilities[:-1]) if p < threshold), None)
        if moved is None:
            result.append((tokens, None))
            continue
        rest = SamplingParams(temperature=0.0, max_tokens=len(tokens) - moved, ignore_eos=True)
        continuation = alone[1].generate([prompt_ids + tokens[:moved]], rest, use_tqdm=False)[0].outputs[0].token_ids
        result.append((tokens[:moved] + continuation, moved))
    return result


def test_a_request_moves_after_its_first_unsure_token(pair, alone, small_reference, caplog):
    probabilities = sorted(min(p[:-1]) for _, _, p in small_reference)
    between = (probabilities[2] + probabilities[3]) / 2  # half of the prompts have a token under it
    for threshold in (0.0, between, 1.0):
        cascade = LLM(cascade=pair, defer_threshold=threshold, progress=False)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hearth"):
            outputs = cascade.generate(PROMPTS, GREEDY, use_tqdm=False)
        moves = [r.getMessage() for r in caplog.records if "moved to the large model" in r.getMessage()]
        for output, (tokens, moved), (_, _, p) in zip(outputs, expected(alone, small_reference, threshold),
                                                      small_reference):
            assert output.outputs[0].token_ids == tokens, threshold
            assert output.outputs[0].text == cascade.get_tokenizer().decode(tokens)
            assert output.cascade.deferred_at == moved
            if moved is not None:
                assert output.cascade.confidence == pytest.approx(p[moved - 1], rel=1e-4)
        deferred = [o.cascade.deferred for o in outputs]
        assert sum(deferred) == {0.0: 0, between: 3, 1.0: 6}[threshold] == len(moves)
        counts = cascade.engine.cascade_totals
        assert (counts.num_requests, counts.num_deferred) == (6, sum(deferred))
        assert counts.num_small_tokens + counts.num_large_tokens == 6 * N
        assert counts.num_small_tokens == sum(o.cascade.deferred_at or N for o in outputs)
    # T = 0: the small model's output whole; T = 1: the large model's continuation of its first token
    assert [t for t, moved in expected(alone, small_reference, 0.0)] == [s for _, s, _ in small_reference]
    assert all(moved == 1 for _, moved in expected(alone, small_reference, 1.0))


def test_a_speculative_step_is_cut_at_the_unsure_token(pair, alone):
    """Prompt lookup guesses a repeated pattern right; the unsure token lies inside an accepted run of guesses."""
    repeat = [[201, 5] * 8]
    ref = reference(alone[0], repeat, 16)
    probabilities = ref[0][2]
    threshold = (probabilities[6] + probabilities[8]) / 2  # under the 7th token's, over the 9th's (about 0.51)
    (tokens, moved), = expected(alone, ref, threshold)
    cascade = LLM(cascade=pair, defer_threshold=threshold, speculative_method="ngram", progress=False)
    output = cascade.generate(repeat, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)[0]
    assert output.outputs[0].token_ids == tokens
    assert output.cascade.deferred_at == moved == next(i + 1 for i, p in enumerate(probabilities) if p < threshold)
    # more guesses were accepted than tokens kept on the small model: a step's tokens after the unsure one went
    assert cascade.engine.small.spec_decode_totals.num_accepted_tokens > moved


def test_served_cascade_streams_across_the_move_and_counts_it(pair, alone, small_reference):
    args = build_parser().parse_args(["serve", "--cascade", ",".join(pair), "--defer-threshold", "1",
                                      "--max-num-seqs", "4"])
    cascade = LLM(cascade=tuple(args.cascade), defer_threshold=args.defer_threshold, progress=False)
    engine = AsyncEngine(cascade.engine)
    (tokens, _), = expected(alone, small_reference[:1], 1.0)
    text = cascade.get_tokenizer().decode(tokens)
    try:
        with serving(build_app(engine, "cascade")) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            reply = client.completions.create(model="cascade", prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert reply.choices[0].text == text
            assert reply.model_extra["hearth"]["cascade"] == [
                {"deferred": True, "deferred_at_token": 1, "confidence": pytest.approx(small_reference[0][2][0]),
                 "small_model_tokens": 1, "large_model_tokens": N - 1}]
            chunks = list(client.completions.create(model="cascade", prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True}))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text
            assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # streamed, not in one piece
            assert chunks[-1].model_extra["hearth"]["cascade"][0]["deferred_at_token"] == 1
            metrics = httpx.get(url + "/metrics").text
            assert 'hearth:cascade_requests_total{model_name="cascade"} 2.0' in metrics
            assert 'hearth:cascade_deferred_requests_total{model_name="cascade"} 2.0' in metrics
            assert f'hearth:cascade_large_model_tokens_total{{model_name="cascade"}} {2.0 * (N - 1)}' in metrics
    finally:
        engine.shutdown()


def test_bad_cascades_are_clear_errors(pair):
    for options, message in [
        (dict(cascade=pair[0], defer_threshold=0.5), "cascade takes two models"),
        (dict(cascade=pair, defer_threshold=1.5), r"defer_threshold is a probability, in \[0, 1\]"),
        (dict(cascade=pair, defer_threshold=-0.1), r"defer_threshold is a probability, in \[0, 1\]"),
        (dict(cascade=pair), "a cascade needs defer_threshold"),
        (dict(defer_threshold=0.5), "defer_threshold is for a cascade"),
        (dict(cascade=pair, defer_threshold=0.5, async_scheduling=True), "not with async_scheduling"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(progress=False, **options)
    with pytest.raises(HearthError, match="either as MODEL"):
        LLM(pair[0], cascade=pair, defer_threshold=0.5, progress=False)
    with pytest.raises(HearthError, match="not with --model"):
        serve(build_parser().parse_args(["serve", "--model", f"a={pair[0]}", "--cascade", ",".join(pair),
                                         "--defer-threshold", "0.5"]))


@pytest.mark.skipif(not SMOLLM2.exists(), reason=f"reference data not found: {SMOLLM2}")
def test_a_cascade_needs_one_vocabulary(pair):
    with pytest.raises(HearthError, match="need one vocabulary"):
        LLM(cascade=(pair[0], str(SMOLLM2)), defer_threshold=0.5, kv_cache_memory=1 << 20, progress=False)
