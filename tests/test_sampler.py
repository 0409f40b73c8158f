import math
from concurrent.futures import Future

import pytest
import scipy.stats as scipy_stats
import torch
import transformers.generation.logits_process as lp

from hearth.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_penalties_and_bias,
    apply_sampling_filters,
    apply_temperature,
    apply_top_k_top_p,
    make_generator,
    prompt_logprobs,
    skip_draws,
)
from hearth.sampling_params import SamplingParams


V = 64
NO_IDS = torch.zeros(1, 1, dtype=torch.long)


def build(params, prompts=None, outputs=None, generators=None, vocab=V, eos=()):
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        generators or [make_generator(p.seed) if p.seed is not None else None for p in params],
        vocab,
        "cpu",
        eos_token_ids=eos,
    )


def assert_same_filtered(ours, ref):
    """Same tokens filtered (-inf) and the same values on the rest."""
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    keep = ~torch.isinf(ref)
    torch.testing.assert_close(ours[keep], ref[keep], rtol=1e-6, atol=1e-6)


def random_logits(rows, seed, vocab=V):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


# ---- each transform against transformers' logits processors, per-row params in one batch ----


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repetition_penalty_matches_hf(seed):
    g = torch.Generator().manual_seed(seed)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.1]
    prompts = [torch.randint(0, V, (9,), generator=g).tolist() for _ in penalties]
    outputs = [torch.randint(0, V, (i,), generator=g).tolist() for i in range(len(penalties))]
    logits = random_logits(len(penalties), seed)
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    ours = apply_penalties_and_bias(logits.clone(), build(params, prompts, outputs))
    for i, p in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = lp.RepetitionPenaltyLogitsProcessor(p)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], ref, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_temperature_matches_hf(seed):
    temps = [1.0, 0.3, 1.7, 0.05, 2.5]
    logits = random_logits(len(temps), seed)
    ours = apply_temperature(logits, build([SamplingParams(temperature=t) for t in temps]).temperature)
    for i, t in enumerate(temps):
        ref = lp.TemperatureLogitsWarper(t)(NO_IDS, logits[i : i + 1])
        torch.testing.assert_close(ours[i : i + 1], ref, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_matches_hf(seed):
    ks = [0, 1, 5, 40, -1, V, 17]
    logits = random_logits(len(ks), seed)
    logits[6, 10:20] = 1.5  # ties at the k-th value: HF keeps them all
    batch = build([SamplingParams(top_k=k) for k in ks])
    ours = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    for i, k in enumerate(ks):
        row = logits[i : i + 1]
        ref = lp.TopKLogitsWarper(k)(NO_IDS, row) if k > 0 else row
        assert_same_filtered(ours[i : i + 1], ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_matches_hf(seed):
    ps = [1.0, 0.9, 0.5, 0.1, 0.01, 0.75, 0.999]
    logits = random_logits(len(ps), seed)
    batch = build([SamplingParams(top_p=p) for p in ps])
    ours = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    for i, p in enumerate(ps):
        row = logits[i : i + 1]
        ref = lp.TopPLogitsWarper(p)(NO_IDS, row) if p < 1.0 else row
        assert_same_filtered(ours[i : i + 1], ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_p_matches_hf(seed):
    mps = [0.0, 0.05, 0.2, 0.5, 0.9, 1.0]
    logits = random_logits(len(mps), seed)
    batch = build([SamplingParams(min_p=m) for m in mps])
    ours = apply_min_p(logits, batch.min_p)
    for i, m in enumerate(mps):
        row = logits[i : i + 1]
        ref = lp.MinPLogitsWarper(m)(NO_IDS, row) if m > 0 else row
        assert_same_filtered(ours[i : i + 1], ref)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_whole_chain_matches_hf(seed):
    """Repetition penalty, temperature, top-k, top-p, min-p in HF's order, per-row params."""
    g = torch.Generator().manual_seed(100 + seed)
    configs = [
        dict(repetition_penalty=1.2, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
        dict(temperature=1.3, top_k=5),
        dict(top_p=0.6, min_p=0.1),
        dict(repetition_penalty=0.8, temperature=0.5, top_p=0.95),
        dict(),
        dict(temperature=2.0, top_k=50, top_p=0.3),
    ]
    prompts = [torch.randint(0, V, (6,), generator=g).tolist() for _ in configs]
    outputs = [torch.randint(0, V, (4,), generator=g).tolist() for _ in configs]
    logits = random_logits(len(configs), seed)
    batch = build([SamplingParams(**c) for c in configs], prompts, outputs)
    ours = apply_sampling_filters(apply_penalties_and_bias(logits, batch), batch)
    for i, c in enumerate(configs):
        ref = logits[i : i + 1]
        procs = []
        if c.get("repetition_penalty", 1.0) != 1.0:
            procs.append(lp.RepetitionPenaltyLogitsProcessor(c["repetition_penalty"]))
        procs.append(lp.TemperatureLogitsWarper(c.get("temperature", 1.0)))
        if c.get("top_k"):
            procs.append(lp.TopKLogitsWarper(c["top_k"]))
        if c.get("top_p", 1.0) < 1.0:
            procs.append(lp.TopPLogitsWarper(c["top_p"]))
        if c.get("min_p"):
            procs.append(lp.MinPLogitsWarper(c["min_p"]))
        ids = torch.tensor([prompts[i] + outputs[i]])
        for proc in procs:
            ref = proc(ids, ref)
        assert_same_filtered(ours[i : i + 1], ref)


def test_presence_frequency_follow_openai_formula():
    # OpenAI: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence,
    # c[j] = how often token j was sampled so far (output tokens only, not the prompt)
    presence, frequency = [0.0, 0.5, -1.0, 2.0], [0.0, 0.3, 1.5, -2.0]
    outputs = [[1, 1, 2], [3, 3, 3, 4], [5], [1, 2, 2, 6, 6, 6]]
    prompts = [[7, 8], [9], [10, 1], [11]]
    logits = random_logits(4, 7)
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in zip(presence, frequency)]
    ours = apply_penalties_and_bias(logits.clone(), build(params, prompts, outputs))
    expected = logits.clone()
    for i in range(4):
        for j in range(V):
            c = outputs[i].count(j)
            expected[i, j] = logits[i, j] - c * frequency[i] - float(c > 0) * presence[i]
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


def test_logit_bias_and_min_tokens():
    logits = random_logits(4, 3)
    eos = [2, 60]
    params = [
        SamplingParams(logit_bias={5: 10.0, 6: -100.0}),
        SamplingParams(min_tokens=3, stop_token_ids=[9]),
        SamplingParams(min_tokens=3, stop_token_ids=[9], ignore_eos=True),
        SamplingParams(min_tokens=2, stop_token_ids=[9]),
    ]
    outputs = [[], [1, 1], [1], [1, 1]]  # row 3 has reached min_tokens
    ours = apply_penalties_and_bias(logits.clone(), build(params, outputs=outputs, eos=eos))
    expected = logits.clone()
    expected[0, 5] += 10.0
    expected[0, 6] -= 100.0
    expected[1, [2, 60, 9]] = -math.inf
    expected[2, 9] = -math.inf  # ignore_eos: EOS does not stop the request, so it is not masked
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


# ---- llama.cpp tests/test-sampling.cpp inline cases ----

PROBS = [0.1, 0.2, 0.3, 0.4]


def filtered_probs(**kwargs):
    logits = torch.tensor([PROBS]).log()
    batch = build([SamplingParams(**kwargs)], vocab=4)
    return apply_sampling_filters(apply_penalties_and_bias(logits, batch), batch).softmax(-1)[0]


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(top_k=1), [0, 0, 0, 1]),
        (dict(top_k=3), [0, 0.22222, 0.33333, 0.44444]),
        (dict(top_k=4), PROBS),
        (dict(top_k=0), PROBS),
        (dict(top_p=0.7), [0, 0, 0.428571, 0.571429]),
        (dict(top_p=0.8), [0, 0.22222, 0.33333, 0.44444]),
        (dict(top_p=1.0), PROBS),
        (dict(min_p=0.24), PROBS),
        (dict(min_p=0.26), [0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
        (dict(min_p=0.49), [0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
        (dict(min_p=0.51), [0, 0, 0.3 / 0.7, 0.4 / 0.7]),
        (dict(min_p=0.74), [0, 0, 0.3 / 0.7, 0.4 / 0.7]),
        (dict(min_p=0.76), [0, 0, 0, 1]),
        (dict(min_p=1.0), [0, 0, 0, 1]),
        (dict(temperature=1.0), PROBS),
    ],
)
def test_llama_cpp_filter_cases(kwargs, expected):
    torch.testing.assert_close(filtered_probs(**kwargs), torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-5)


def test_llama_cpp_temperature_zero_is_one_hot():
    out = Sampler()(torch.tensor([PROBS]).log(), build([SamplingParams(temperature=0)], vocab=4))
    assert out.sampled_token_ids.tolist() == [3]


@pytest.mark.parametrize(
    "last_tokens, repeat, freq, pres, expected",
    [
        ([0], 50.0, 0.0, 0.0, [0, 0.25, 0.25, 0.25, 0.25]),
        ([0, 1, 2], 50.0, 0.0, 0.0, [0, 0, 0, 0.5, 0.5]),
        ([0, 1, 2, 0, 0], 50.0, 0.0, 0.0, [0, 0, 0, 0.5, 0.5]),
        ([0], 1.0, 5.0, 5.0, [0.000011, 0.249997, 0.249997, 0.249997, 0.249997]),
        ([0, 1, 2], 1.0, 5.0, 5.0, [0.000023, 0.000023, 0.000023, 0.499966, 0.499966]),
        ([0, 1, 2, 0, 0], 1.0, 5.0, 5.0, [0.000000, 0.000023, 0.000023, 0.499977, 0.499977]),
    ],
)
def test_llama_cpp_penalty_cases(last_tokens, repeat, freq, pres, expected):
    # llama.cpp accepts penalties beyond OpenAI's [-2, 2]; the building block takes any value
    logits = torch.full((1, 5), 0.2).log()
    p = SamplingParams(repetition_penalty=repeat)
    batch = build([p], outputs=[last_tokens], vocab=5)
    if freq or pres:
        batch.presence_penalty = torch.tensor([pres])
        batch.frequency_penalty = torch.tensor([freq])
        batch.output_counts = torch.bincount(torch.tensor(last_tokens), minlength=5).float()[None]
    probs = apply_penalties_and_bias(logits, batch).softmax(-1)[0]
    torch.testing.assert_close(probs, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-5)


def test_seed_document_top_p_example():
    # seeds/003: with p = 0.6, nucleus sampling keeps apple (.3), banana (.2) and cherry (.15)
    probs = torch.tensor([[0.3, 0.2, 0.15, 0.1, 0.1, 0.1, 0.05]])
    batch = build([SamplingParams(top_p=0.6)], vocab=7)
    kept = ~torch.isinf(apply_top_k_top_p(probs.log(), batch.top_k, batch.top_p))[0]
    assert kept.tolist() == [True, True, True, False, False, False, False]


# ---- sampled frequencies follow the transformed distribution ----

BOUNDARY = [0.35, 0.25, 0.2, 0.12, 0.08]  # top_p 0.75 keeps 3 tokens; one more or one fewer is far off


def normalized(weights):
    total = sum(weights)
    return [w / total for w in weights]


CHI_CASES = [
    # (params, expected distribution, from the definitions, not from the code)
    (dict(), BOUNDARY),
    (dict(temperature=0.5), normalized([p**2 for p in BOUNDARY])),
    (dict(temperature=2.0), normalized([p**0.5 for p in BOUNDARY])),
    (dict(top_k=2), normalized(BOUNDARY[:2] + [0, 0, 0])),
    (dict(top_p=0.75), normalized(BOUNDARY[:3] + [0, 0])),
    (dict(top_p=0.55), normalized(BOUNDARY[:2] + [0, 0, 0])),
    (dict(min_p=0.3), normalized(BOUNDARY[:4] + [0])),  # 0.3 * 0.35 = 0.105: 0.12 stays, 0.08 goes
    (dict(min_p=0.6), normalized(BOUNDARY[:2] + [0, 0, 0])),
    (dict(temperature=0.5, top_k=3, top_p=0.8), normalized([p**2 for p in BOUNDARY[:2]] + [0, 0, 0])),
]


def test_sampled_frequencies_match_distribution():
    """All cases interleaved in one batch (per-row params), 20k draws each, chi-square at fixed seed."""
    torch.manual_seed(1234)
    draws = 20000
    params = [SamplingParams(**c) for c, _ in CHI_CASES]
    logits_row = torch.tensor(BOUNDARY).log()
    batch = build(params * draws, vocab=5)
    out = Sampler()(logits_row.expand(len(params) * draws, 5).clone(), batch)
    tokens = out.sampled_token_ids.view(draws, len(params))
    for j, (kwargs, expected) in enumerate(CHI_CASES):
        counts = torch.bincount(tokens[:, j], minlength=5)
        expected = torch.tensor(expected, dtype=torch.float64)
        assert torch.all(counts[expected == 0] == 0), f"{kwargs}: filtered token drawn {counts.tolist()}"
        keep = expected > 0
        f_exp = (expected[keep] * draws).numpy()
        result = scipy_stats.chisquare(counts[keep].double().numpy(), f_exp)
        assert result.pvalue > 1e-3, f"{kwargs}: counts {counts.tolist()} vs {f_exp.tolist()}"


def test_sampled_frequencies_match_hf_chain_on_random_logits():
    torch.manual_seed(99)
    vocab, draws = 12, 30000
    logits_row = random_logits(1, 5, vocab)[0] / 2
    kwargs = dict(temperature=0.8, top_k=8, top_p=0.85, min_p=0.05)
    ref = logits_row[None]
    for proc in (
        lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(8), lp.TopPLogitsWarper(0.85), lp.MinPLogitsWarper(0.05)
    ):
        ref = proc(NO_IDS, ref)
    expected = ref.softmax(-1)[0].double()
    out = Sampler()(logits_row.expand(draws, vocab).clone(), build([SamplingParams(**kwargs)] * draws, vocab=vocab))
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab)
    assert torch.all(counts[expected == 0] == 0)
    keep = expected > 0
    assert keep.sum() >= 3  # the case filters something and keeps a choice
    result = scipy_stats.chisquare(counts[keep].double().numpy(), (expected[keep] * draws).numpy())
    assert result.pvalue > 1e-3


# ---- greedy, seeds, logprobs ----


def test_greedy_rows_are_exact_argmax_in_mixed_batch():
    logits = random_logits(6, 11)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0, logit_bias={7: 50.0}),
        SamplingParams(temperature=0.7, seed=5),
        SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=2.0),
        SamplingParams(temperature=0, min_tokens=2),
    ]
    prompts = [[], [], [], [], [int(logits[4].argmax())], []]
    outputs = [[], [], [], [], [int(logits[4].argmax())] * 2, []]
    eos = [int(logits[5].argmax())]
    batch = build(params, prompts, outputs, eos=eos)
    out = Sampler()(logits.clone(), batch)
    expected = apply_penalties_and_bias(logits, batch).argmax(-1)
    greedy = [0, 2, 4, 5]
    assert out.sampled_token_ids[greedy].tolist() == expected[greedy].tolist()
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.sampled_token_ids[2] == 7  # bias and penalties apply to greedy rows too
    assert out.sampled_token_ids[4] != logits[4].argmax()
    assert out.sampled_token_ids[5] != eos[0]
    assert out.sampled_token_ids[1] in logits[1].topk(3).indices
    # an all-greedy batch takes the same answer
    all_greedy = [0, 2, 4, 5]
    sub = build([params[i] for i in all_greedy], [prompts[i] for i in all_greedy],
                [outputs[i] for i in all_greedy], eos=eos)
    assert Sampler()(logits[all_greedy].clone(), sub).sampled_token_ids.tolist() == expected[greedy].tolist()


def run_steps(rows, steps_logits):
    """rows: list of SamplingParams; returns per-row token lists over the steps, fresh generators."""
    gens = [make_generator(p.seed) if p.seed is not None else None for p in rows]
    tokens = [[] for _ in rows]
    sampler = Sampler()
    for logits_by_row in steps_logits:
        batch = build(rows, outputs=tokens, generators=gens)
        out = sampler(torch.stack([logits_by_row(i) for i in range(len(rows))]), batch)
        for i, t in enumerate(out.sampled_token_ids.tolist()):
            tokens[i].append(t)
    return tokens


def test_seeded_rows_do_not_depend_on_batch():
    base = random_logits(20, 21) / 3  # flat enough that draws vary
    steps = 8
    target = SamplingParams(seed=42, top_p=0.95, presence_penalty=0.5)
    other_seeded = SamplingParams(seed=7, temperature=1.3)
    unseeded = SamplingParams(top_k=10)
    greedy = SamplingParams(temperature=0)

    def steps_for(order):
        # every row sees the same logits at the same step, whatever its position
        return [lambda i, s=s, order=order: base[(s + order[i]) % 20] for s in range(steps)]

    torch.manual_seed(0)
    alone = run_steps([target], steps_for([0]))[0]
    torch.manual_seed(1)
    mixed = run_steps([unseeded, other_seeded, target, greedy], steps_for([3, 1, 0, 2]))
    torch.manual_seed(2)
    reordered = run_steps([target, greedy, unseeded, other_seeded, unseeded], steps_for([0, 2, 3, 1, 5]))
    assert mixed[2] == alone and reordered[0] == alone
    assert mixed[1] == reordered[3]  # the other seeded row too
    assert len(set(alone)) > 1
    different_seed = run_steps([SamplingParams(seed=43, top_p=0.95, presence_penalty=0.5)], steps_for([0]))[0]
    assert different_seed != alone


def test_seeded_row_needs_its_generator():
    with pytest.raises(ValueError, match="generator"):
        SamplingBatch.build([SamplingParams(seed=1)], [[]], [[]], [None], V, "cpu")


def test_logprobs_are_raw_log_softmax():
    logits = random_logits(5, 31)
    params = [
        SamplingParams(logprobs=3, repetition_penalty=1.5, temperature=0.5),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0, logprobs=5, logit_bias={1: 30.0}),
        SamplingParams(top_k=2),
        SamplingParams(seed=3, logprobs=1),
    ]
    out = Sampler()(logits.clone(), build(params, prompts=[[1, 2, 3]] * 5))
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.sampled_token_ids[:, None])[:, 0])
    ids, lps = out.top_logprobs
    assert ids.shape == lps.shape == (5, 5)
    top_values, top_ids = ref.topk(5, -1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(lps, top_values)
    assert torch.all(lps[:, :-1] >= lps[:, 1:])
    assert out.sampled_token_ids[2] == 1 and out.sampled_token_ids.dtype == torch.int64

    none_asked = Sampler()(logits[:4].clone(), build([SamplingParams(), SamplingParams(logprobs=0)] * 2))
    assert none_asked.top_logprobs is None
    everything = Sampler()(logits[:1].clone(), build([SamplingParams(logprobs=-1)]))
    assert everything.top_logprobs[0].shape == (1, V)


def test_prompt_logprobs():
    logits = random_logits(7, 41)
    targets = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    chosen, ids, lps = prompt_logprobs(logits, targets, 4)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(chosen, ref[torch.arange(7), targets])
    top_values, top_ids = ref.topk(4, -1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(lps, top_values)
    _, ids0, lps0 = prompt_logprobs(logits, targets, 0)
    assert ids0.shape == lps0.shape == (7, 0)
    assert prompt_logprobs(logits, targets, -1)[1].shape == (7, V)


def test_grammar_bitmask_masks_only_its_rows_and_greedy_obeys_it():
    """Bit t of a row's int32 words (little-endian within each word) allows token t."""
    V_odd = 70  # not a multiple of 32: the last word's high bits lie past the vocabulary
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V_odd, generator=gen)
    allowed = torch.rand(2, V_odd, generator=gen) < 0.3
    allowed[:, 5] = True
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same bits as int32
    params = [SamplingParams(temperature=0)] * 3
    filled = Future()  # as GrammarCompiler.start_masks hands the masks over
    filled.set_result(bitmask)
    batch = SamplingBatch.build(params, [[]] * 3, [[]] * 3, [None] * 3, V_odd, "cpu", grammar_masks=([0, 2], filled))
    out = apply_penalties_and_bias(logits, batch)
    expected = logits.clone()
    expected[0][~allowed[0]] = -math.inf
    expected[2][~allowed[1]] = -math.inf
    assert torch.equal(out, expected)  # row 1 is unconstrained: untouched
    sampled = Sampler()(logits, batch).sampled_token_ids
    assert sampled.tolist() == [expected[0].argmax().item(), logits[1].argmax().item(), expected[2].argmax().item()]


def test_noise_is_drawn_before_the_grammar_masks_are_awaited():
    """The masks' thread works while the sampler draws its noise: when the sampler first asks
    for the masks, a seeded row's generator has already made its V draws (as skip_draws says),
    and the token is still the masked distribution's draw with that noise."""
    V = 50
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    bitmask = torch.tensor([[0b1011_0110, 0]], dtype=torch.int32)  # tokens 1, 2, 4, 5, 7 of row 1
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.8, seed=6)]
    generators = [make_generator(5), make_generator(6)]
    after_draws = make_generator(6)
    skip_draws(after_draws, 1, V)
    states_when_asked = []

    class Masks(Future):
        def result(self, timeout=None):
            states_when_asked.append(generators[1].get_state())
            return super().result(timeout)

    masks = Masks()
    masks.set_result(bitmask)
    batch = SamplingBatch.build(params, [[]] * 2, [[]] * 2, generators, V, "cpu", grammar_masks=([1], masks))
    sampled = Sampler()(logits, batch).sampled_token_ids.tolist()
    assert states_when_asked and torch.equal(states_when_asked[0], after_draws.get_state())
    noise = torch.empty(V).exponential_(generator=make_generator(6))
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[1, 2, 4, 5, 7]] = True
    probs = (logits[1] / 0.8).masked_fill(~allowed, -math.inf).softmax(-1)
    assert sampled[1] == (probs / noise).argmax().item()
