"""Speculative decoding on hybrid models (layers with a state per sequence): a verification keeps the
states after each guess (hearth/backend/state_ops.py's snapshots) and the engine puts back those at the
last kept one, so that a rejected guess never stays in the states. Greedy tokens equal plain decoding's
(which test_hybrid_models.py holds to transformers'), sampled ones keep its distribution; what cannot
run yet is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.backend.state_ops import StateMetadata, causal_conv1d, gated_delta_rule, ssm_scan
from hearth.errors import HearthError
from models import make_hf_model
from test_engine import random_prompts
from test_speculative import assert_same_distribution, first_tokens, speculation

REPEATING = [7, 8, 9, 10] * 4 + [7, 8]  # its continuation is guessed from the prompt
PROMPTS = [REPEATING, *random_prompts(2, seed=5, shortest=6, longest=30)]
MAX_TOKENS = 20


def test_snapshots_are_the_states_after_each_row():
    """A sequence of 5 rows verifying guesses, from a state of its own: its outputs are the chunked form's,
    its slot ends with the state after its last row and the snapshot slots hold the states after each
    row before, each as the chunked form leaves it after that row alone."""
    rows, channels, taps, heads, dk, dv, slot, first_snapshot = 5, 12, 4, 2, 8, 6, 1, 3
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    x, weight, bias = randn(rows, channels), randn(channels, taps), randn(channels)
    q, k = (torch.nn.functional.normalize(randn(rows, heads, dk), dim=-1) for _ in range(2))
    v, g, beta = randn(rows, heads, dv), -randn(rows, heads).abs(), randn(rows, heads).sigmoid()
    windows, states = randn(8, channels, taps - 1), randn(8, heads, dk, dv)

    def meta(n: int, snapshot: int) -> StateMetadata:
        return StateMetadata.from_step(np.array([slot]), np.array([0, n]), np.array([10 + n]), torch.device("cpu"),
                                       np.array([snapshot]))

    ops = [lambda n, s, m: causal_conv1d(x[:n], s, weight, bias, m, "silu"),
           lambda n, s, m: gated_delta_rule(q[:n], k[:n], v[:n], g[:n], beta[:n], s, m),
           lambda n, s, m: ssm_scan(q[:n], k[:n], v[:n], g[:n], s, m)]
    for op, initial in zip(ops, (windows, states, states)):
        verified = initial.clone()
        out = op(rows, verified, meta(rows, first_snapshot))
        for n in range(1, rows + 1):  # the chunked form on the first n rows alone, no snapshots
            alone = initial.clone()
            torch.testing.assert_close(out[:n], op(n, alone, meta(n, -1)), rtol=1e-4, atol=1e-5)
            kept = verified[slot] if n == rows else verified[first_snapshot + n - 1]
            torch.testing.assert_close(kept, alone[slot], rtol=1e-4, atol=1e-5)
        untouched = [s for s in range(8) if s != slot and not first_snapshot <= s < first_snapshot + rows - 1]
        assert torch.equal(verified[untouched], initial[untouched])


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def family(request, tmp_path_factory):
    """(architecture, folder, plain greedy tokens of PROMPTS)."""
    folder = make_hf_model(tmp_path_factory.mktemp(request.param) / "m", request.param)
    return request.param, folder, _greedy(LLM(folder, progress=False))


@pytest.fixture(scope="module")
def llama_draft(tmp_path_factory):
    """A plain transformer with the hybrids' vocabulary as their draft."""
    return make_hf_model(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=1)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "lookahead", "draft unlike"])
def test_greedy_speculation_keeps_plain_tokens(family, llama_draft, method):
    """Every method's greedy tokens are plain decoding's, with guesses rejected (nemotron_h's lookahead: some
    after others were accepted). Without putting back the states at the last kept guess the tokens after
    a rejection differ (every case but nemotron_h's prompt lookup, whose few rejections come late)."""
    arch, folder, plain = family
    llm = LLM(folder, progress=False, **speculation(method, folder, llama_draft))
    assert _greedy(llm) == plain
    counts = llm.engine.spec_decode_totals
    assert counts.num_accepted_tokens < counts.num_draft_tokens
    if arch == "nemotron_h" and method == "lookahead":  # a first guess kept, a later one of its chain not
        assert 0 < counts.accepted_per_position[-1] < counts.accepted_per_position[0]
    assert llm.engine.scheduler.state_slots.num_free == llm.engine.num_state_slots


def test_state_checkpoints_taken_between_guesses(family):
    """A checkpoint every block (so that guesses run up to boundaries during decoding): a conversation's
    next turn (the first prompt, its output and more) starts from the checkpoint its first turn left
    while guessing, and its tokens are those of an engine that computes it all."""
    arch, folder, plain = family
    llm = LLM(folder, progress=False, **speculation("ngram", folder, None))
    llm.engine.block_manager.checkpoints.interval_blocks = 1
    assert _greedy(llm) == plain
    next_turn = PROMPTS[0] + plain[0] + [3, 4, 5]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    output = llm.generate([next_turn], params, use_tqdm=False)[0]
    assert output.num_cached_tokens == 32  # the block boundary before the prompt's last token
    reference = LLM(folder, progress=False, enable_prefix_caching=False).generate([next_turn], params, use_tqdm=False)
    assert output.outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_sampled_speculation_keeps_the_distribution(tmp_path):
    """Unseeded draws of the first tokens on nemotron_h, prompt lookup against plain: one distribution
    (chi-square at the second to fourth tokens, where guesses were verified, some rejected). The prompt:
    the model's greedy text twice, whose continuation its draws often follow."""
    folder = make_hf_model(tmp_path / "m", "nemotron_h")
    llm = LLM(folder, progress=False, seed=1)
    prompt = 2 * llm.generate([REPEATING], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=0.15, max_tokens=4, ignore_eos=True)
    plain = first_tokens(llm, prompt, params, 200)
    llm = LLM(folder, progress=False, seed=2, **speculation("ngram", folder, None))
    speculative = first_tokens(llm, prompt, params, 200)
    counts = llm.engine.spec_decode_totals
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    assert_same_distribution(plain, speculative, (1, 2, 3))


def test_token_trees_and_early_exit_refused_by_name(family):
    arch, folder, _ = family
    for method, what in [("early-exit", "speculative_method early-exit"), ("ngram tree", "token trees of guesses"),
                         ("lookahead full", "token trees of guesses")]:
        with pytest.raises(HearthError, match=f"{what}.* is not implemented for a hybrid model \\({arch}"):
            LLM(folder, progress=False, **speculation(method, folder, None))
