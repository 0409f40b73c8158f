"""Speculative decoding: the verification of guesses, draft models, KV blocks, the engine's options.

Greedy outputs with speculation are checked against transformers by test_engine's matrix and
test_generation (both run with and without it); here: sampled outputs against the target
distribution (chi-square), drafts against their own greedy continuation, and the bookkeeping.
Where guesses come from and how many: test_speculative_guesses.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy import stats

from hearth import LLM, SamplingParams
from hearth.engine_config import EngineConfig
from hearth.engine.sampler import Guesses, Sampler
from models import VOCAB_SIZE, load_hf_reference, make_draft_model, make_hf_model
from test_sampler import build

P_VALUE = 1e-3  # the draws are seeded: a pass is reproducible, a real bias fails far below this


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("speculative") / "llama", "llama")


@pytest.mark.parametrize("draft", ["point mass, unlikely", "point mass, certain", "unlike", "identical"])
def test_verification_keeps_the_target_distribution(draft):
    """Rows with a guess g ~ q yield tokens distributed as the target p, whatever the draft q, and
    accept sum_x min(p(x), q(x)) of the guesses (the rejection rule's rate): a point mass on a token
    p finds unlikely, a point mass on the token p is certain of (top_k=1), a draft unlike p, and
    q = p (every guess accepted). A point mass keeps plain decoding's draw: accepted iff x == g."""
    torch.manual_seed(0)
    vocab, draws = 24, 20_000
    logits = torch.randn(vocab) * 1.5
    params = SamplingParams(temperature=1.0, top_k=1 if draft == "point mass, certain" else 0)
    rows = logits.repeat(draws, 1)
    p = torch.softmax(rows, dim=-1)  # as the sampler computes it
    if draft == "point mass, certain":
        p = torch.nn.functional.one_hot(logits.argmax(), vocab).float().repeat(draws, 1)
    q = {"point mass, unlikely": torch.nn.functional.one_hot(logits.argsort()[2], vocab).float().repeat(draws, 1),
         "point mass, certain": p,
         "unlike": torch.softmax(torch.randn(vocab) * 1.5, dim=0).repeat(draws, 1),
         "identical": p}[draft]
    guesses = torch.multinomial(q, 1).squeeze(1)
    out = Sampler()(rows.clone(), build([params] * draws, vocab=vocab),
                    Guesses(torch.arange(draws), guesses, q, [None] * draws))
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab).double()
    accepted = int(out.accepted.sum())
    expected_rate = torch.minimum(p[0], q[0]).sum().item()
    if draft.startswith("point mass"):
        assert torch.equal(out.accepted, out.sampled_token_ids == guesses)
    if expected_rate > 1 - 1e-6:
        assert accepted == draws
    else:
        assert stats.binomtest(accepted, draws, expected_rate).pvalue > P_VALUE
    expected = p[0].double() / p[0].double().sum() * draws
    if draft != "point mass, certain":
        assert (expected >= 5).all()  # chi-square wants expected counts of at least 5
        assert stats.chisquare(counts, expected).pvalue > P_VALUE
    else:
        assert torch.equal(counts, expected)


@pytest.mark.parametrize("first", ["point mass", "unlike", "identical"])
def test_sibling_guesses_keep_the_target_distribution(first):
    """A token tree's row with several guesses: its first (a point mass, or drawn from a draft q),
    then two sibling point masses (one likely, one not) verified by the recursive rule. The row's
    tokens are distributed as p, at most one guess is kept, and a sibling is kept exactly when the
    first is rejected and the row's token is that sibling."""
    torch.manual_seed(1)
    vocab, draws = 24, 20_000
    logits = torch.randn(vocab) * 1.5
    p = torch.softmax(logits, dim=-1)
    q = {"point mass": torch.nn.functional.one_hot(logits.argsort()[3], vocab).float(),
         "unlike": torch.softmax(torch.randn(vocab) * 1.5, dim=0), "identical": p}[first]
    firsts = torch.multinomial(q, draws, replacement=True)
    by_rank = logits.argsort(descending=True)
    siblings = torch.stack([torch.stack([t for t in by_rank[[0, 1, -1]] if t != f][:2]) for f in firsts])  # [draws, 2]
    guesses = torch.stack([firsts, siblings[:, 0], siblings[:, 1]], dim=1).reshape(-1)
    out = Sampler()(logits.repeat(draws, 1), build([SamplingParams(temperature=1.0)] * draws, vocab=vocab),
                    Guesses(torch.arange(draws).repeat_interleave(3), guesses, q.repeat(3 * draws, 1),
                            [None] * (3 * draws), [False, True, True] * draws))
    accepted = out.accepted.view(draws, 3)
    assert (accepted.sum(dim=1) <= 1).all()
    assert torch.equal(accepted[:, 1:], (out.sampled_token_ids[:, None] == siblings) & ~accepted[:, :1])
    if first == "identical":
        assert accepted[:, 0].all()
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab).double()
    assert stats.chisquare(counts, p.double() / p.double().sum() * draws).pvalue > P_VALUE


@pytest.mark.parametrize("draft", ["point masses", "a draft's distributions"])
def test_greedy_verification_keeps_the_argmax(draft):
    """Greedy rows (temperature 0): every row's token is the argmax of its logits, and a guess is
    kept exactly where it equals that argmax, whatever q it was drawn from."""
    torch.manual_seed(1)
    vocab, rows = 24, 400
    logits = torch.randn(rows, vocab)
    argmax = logits.argmax(dim=-1)
    q = (torch.softmax(torch.randn(rows, vocab) * 2, dim=-1) if draft != "point masses" else
         torch.nn.functional.one_hot(torch.randint(vocab, (rows,)), vocab).float())
    guesses = torch.where(torch.rand(rows) < 0.5, argmax, torch.multinomial(q, 1).squeeze(1))
    out = Sampler()(logits.clone(), build([SamplingParams(temperature=0)] * rows, vocab=vocab),
                    Guesses(torch.arange(rows), guesses, q, [None] * rows))
    assert torch.equal(out.sampled_token_ids, argmax)
    assert torch.equal(out.accepted, guesses == argmax)
    assert 0 < int(out.accepted.sum()) < rows


def first_tokens(llm: LLM, prompt: list[int], params: SamplingParams, count: int) -> list[tuple[int, ...]]:
    return [tuple(o.outputs[0].token_ids) for o in llm.generate([prompt] * count, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def unlike_draft(tmp_path_factory):
    """A draft with the target's vocabulary and weights of its own (another random model)."""
    return make_hf_model(tmp_path_factory.mktemp("speculative") / "other", "llama", seed=1)


def speculation(method: str, folder, unlike_draft) -> dict:
    """The LLM options of prompt lookup, a draft unlike the target, and the target as its own draft;
    "... tree": with token trees of three branches."""
    if method.endswith(" tree"):
        return speculation(method.removesuffix(" tree"), folder, unlike_draft) | dict(speculative_tree_width=3)
    if method == "ngram":
        return dict(speculative_method="ngram", prompt_lookup_min=1, speculative_adaptive=False)
    if method.startswith("lookahead"):  # "lookahead full": as published, a token tree
        return dict(speculative_method="lookahead", speculative_adaptive=False,
                    lookahead_mode=method.removeprefix("lookahead").strip() or "chain")
    if method == "early-exit":  # the first of the model's two layers drafts
        return dict(speculative_method="early-exit", exit_layer=1, speculative_adaptive=False)
    draft = unlike_draft if method == "draft unlike" else folder
    return dict(speculative_method="draft", speculative_model=draft, speculative_adaptive=False)


METHODS = ["ngram", "draft unlike", "draft identical", "ngram tree", "draft unlike tree", "draft identical tree",
           "early-exit", "early-exit tree", "lookahead full"]


REPEATING_PROMPT = [7, 8, 9, 10] * 4 + [7, 8]  # its continuation is guessed from the prompt


@pytest.fixture(scope="module")
def plain_draws(folder):
    """temperature -> 600 draws of the first 4 tokens after REPEATING_PROMPT without speculation (an
    engine seeded 1: the same draws for every method below, made once per temperature)."""
    draws = {}

    def plain(params: SamplingParams) -> list[tuple[int, ...]]:
        if params.temperature not in draws:
            draws[params.temperature] = first_tokens(LLM(folder, progress=False, seed=1), REPEATING_PROMPT, params, 600)
        return draws[params.temperature]

    return plain


@pytest.mark.parametrize("method", METHODS)
def test_sampled_outputs_keep_the_distribution_through_the_engine(folder, unlike_draft, plain_draws, method):
    """Unseeded draws of the first tokens, speculative against plain: the same distribution
    (chi-square on the second to fourth tokens, where guesses were verified). The target as its
    own draft has every guess accepted."""
    prompt = REPEATING_PROMPT
    params = SamplingParams(temperature=0.15 if method.startswith("ngram") else 0.7, max_tokens=4, ignore_eos=True)
    plain = plain_draws(params)
    llm = LLM(folder, progress=False, seed=2, **speculation(method, folder, unlike_draft))
    speculative = first_tokens(llm, prompt, params, 600)
    counts = llm.engine.spec_decode_totals
    if method == "draft identical":
        assert counts.num_draft_tokens > 0 and counts.acceptance_rate == 1
    elif method == "draft identical tree":  # the first guess of each step (drawn as the target would) always kept
        assert counts.num_drafts > 0 and counts.accepted_per_position[0] == counts.num_drafts
    else:
        assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    assert_same_distribution(plain, speculative, (1, 2, 3))


def assert_same_distribution(plain: list[tuple[int, ...]], speculative: list[tuple[int, ...]],
                             positions: tuple[int, ...]) -> None:
    """At each position, the tokens drawn plainly and speculatively: one distribution (chi-square
    contingency on the tokens drawn at least 10 times in all, the rest as one "other" column)."""
    for position in positions:
        a = [t[position] for t in plain]
        b = [t[position] for t in speculative]
        common = sorted({t for t in a + b if a.count(t) + b.count(t) >= 10})
        table = [[sum(x == t for x in xs) for t in common] + [sum(x not in common for x in xs)] for xs in (a, b)]
        table = [row for row in zip(*table) if sum(row)]  # drop an empty "other" column
        assert stats.chi2_contingency(list(zip(*table))).pvalue > P_VALUE, position


def test_seeded_requests_keep_plain_decoding_tokens_with_ngram_trees(folder):
    """Prompt lookup's guesses are point masses: a seeded request's tokens with token trees are
    those of plain decoding (the rows at one depth of a tree draw with the noise plain decoding
    draws there), while branches other than the first are accepted."""
    rng = random.Random(5)
    prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(3, 9))] * 3 for _ in range(8)]
    params = [SamplingParams(temperature=0.15, max_tokens=32, seed=seed, ignore_eos=True) for seed in range(8)]
    plain = LLM(folder, progress=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(folder, progress=False, **speculation("ngram tree", folder, None))
    moves = []
    move = llm.engine.runner._move_kept_guesses
    llm.engine.runner._move_kept_guesses = lambda kept: moves.extend(kept) or move(kept)
    tree = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tree] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.spec_decode_totals.num_accepted_tokens > 0 and moves


def run_checking_guesses(engine, check) -> int:
    """Step the engine until its requests finish; where a step's guesses are planned (before the
    scheduler trims them), check(request) each running request with guesses. Returns the sum of
    what the checks returned."""
    checked, schedule = 0, engine.scheduler.schedule

    def checking_schedule():
        nonlocal checked
        checked += sum(check(request) for request in engine.scheduler.running if request.spec_token_ids)
        return schedule()

    engine.scheduler.schedule = checking_schedule
    while engine.has_unfinished_requests():
        engine.step()
    return checked


@pytest.mark.parametrize("tree_width", [1, 3])
def test_draft_passes_guess_the_drafts_own_greedy_continuation(folder, unlike_draft, tree_width):
    """The draft's passes run in one call, each fed the guess drawn before it on the device
    (draft_runner.DraftRunner.propose): as planned for every step, each branch of a greedy
    request's guesses is what the draft model generates alone from the request's tokens (and the
    branch's first token, for the others of a tree), with a repetition penalty that counts the
    guesses drawn before."""
    k = 4
    penalised = dict(temperature=0, ignore_eos=True, repetition_penalty=1.5)
    alone = LLM(unlike_draft, progress=False)
    llm = LLM(folder, progress=False, speculative_method="draft", speculative_model=unlike_draft,
              speculative_adaptive=False, num_speculative_tokens=k, speculative_tree_width=tree_width)
    engine = llm.engine
    for i, prompt in enumerate([[7, 8, 9, 10] * 3, [3, 5, 7, 11, 13], [40, 2, 40, 2, 9]]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=16 + i, **penalised))

    def check(request) -> int:
        guesses = request.spec_token_ids
        depth = len(guesses) // tree_width  # the branches one after another (tree_of: nothing merges)
        for b in range(0, len(guesses), depth):
            branch, start = guesses[b : b + depth], (guesses[b : b + 1] if b else [])
            drafted = alone.generate([request.all_token_ids + start],
                                     SamplingParams(max_tokens=depth - len(start), **penalised), use_tqdm=False)
            assert branch == start + drafted[0].outputs[0].token_ids, (request.request_id, b)
        return len(guesses) // depth

    assert run_checking_guesses(engine, check) >= 10 * tree_width
    assert engine.runner.draft.block_manager.check_all_free()


@pytest.mark.parametrize("method", ["draft unlike", "draft unlike tree"])
def test_seeded_draft_speculation_is_reproducible(folder, unlike_draft, method):
    """A seeded request's tokens with a draft do not depend on the batch it runs in."""
    llm = LLM(folder, progress=False, **speculation(method, folder, unlike_draft))
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True) for seed in range(6)]
    prompt = [7, 8, 9, 10] * 3
    together = llm.generate([prompt] * 6, params, use_tqdm=False)
    alone = [llm.generate([prompt], p, use_tqdm=False)[0] for p in params[::-1]][::-1]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert llm.engine.spec_decode_totals.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "lookahead", "draft unlike", "ngram tree", "draft unlike tree",
                                    "early-exit"])
def test_every_block_free_after_rejected_preempted_and_aborted_requests(folder, unlike_draft, method):
    """A small cache (preemption), guesses often rejected (slots given back), aborts mid-way: every
    block of the target's cache and of the draft's is free at the end."""
    kv_bytes_per_token = 2 * 2 * 2 * 16 * 4
    llm = LLM(folder, progress=False, kv_cache_memory=10 * 16 * kv_bytes_per_token,
              **speculation(method, folder, unlike_draft))
    engine = llm.engine
    rng = random.Random(3)
    ids = []
    for i in range(12):
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(3, 12))] * 3
        ids.append(engine.add_request(None, prompt, SamplingParams(temperature=0.3 if i % 2 else 0, max_tokens=40,
                                                                   ignore_eos=True, seed=i)))
    preempted = 0
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        preempted += engine.last_step.num_preempted
        if step == 6:
            for request_id in ids[::4]:
                engine.abort_request(request_id)
        for request in engine.scheduler.running:  # decoding: the blocks of its computed tokens, no more
            if request.num_tokens - request.num_computed_tokens == 1:
                assert len(request.block_table) == engine.block_manager.blocks_needed(request.num_computed_tokens)
    assert not engine.has_unfinished_requests()
    counts = engine.spec_decode_totals
    assert preempted > 0 and 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    assert engine.block_manager.check_all_free()
    if method.startswith("draft"):
        assert engine.runner.draft.block_manager.check_all_free()


@pytest.mark.parametrize("method", ["ngram", "draft unlike", "draft unlike tree", "early-exit"])
def test_a_request_can_opt_out(folder, unlike_draft, method):
    llm = LLM(folder, progress=False, **speculation(method, folder, unlike_draft))
    prompt = [7, 8, 9, 10] * 4
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculative=False)
    llm.generate([prompt] * 3, greedy, use_tqdm=False)
    assert llm.engine.spec_decode_totals.num_draft_tokens == 0
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")


def test_a_draft_with_another_vocabulary_is_refused(folder, tmp_path):
    other = make_hf_model(tmp_path / "other-vocab", "llama", vocab_size=VOCAB_SIZE + 8)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(folder, progress=False, speculative_method="draft", speculative_model=other)


def test_unimplemented_methods_and_missing_drafts_are_refused():
    for method in ("tree", "eagle"):
        with pytest.raises(ValueError, match="not implemented"):
            EngineConfig.from_options(speculative_method=method)
    with pytest.raises(ValueError, match="needs a speculative_model"):
        EngineConfig.from_options(speculative_method="draft")
    with pytest.raises(ValueError, match="needs speculative_method draft"):
        EngineConfig.from_options(speculative_method="ngram", speculative_model="builtin")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_options(speculative_method="draft", speculative_model="builtin-draft", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig.from_options(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="lookahead makes trees of its own"):
        EngineConfig.from_options(speculative_method="lookahead", speculative_tree_width=2)
    full = EngineConfig.from_options(speculative_method="lookahead", lookahead_mode="full").speculative
    assert full.num_speculative_tokens == (3 + 2) * (4 - 1) and full.token_trees  # W x (N - 1) + G x (N - 1) rows
    with pytest.raises(ValueError, match="rows must be below 16"):
        EngineConfig.from_options(speculative_method="lookahead", lookahead_mode="full", lookahead_window=4)
    with pytest.raises(ValueError, match="lookahead_mode must be one of chain, full"):
        EngineConfig.from_options(speculative_method="lookahead", lookahead_mode="tree")
    with pytest.raises(ValueError, match="lookahead_ngram >= 3"):
        EngineConfig.from_options(speculative_method="lookahead", lookahead_ngram=2)
    with pytest.raises(ValueError, match="must be below 16"):
        EngineConfig.from_options(speculative_method="ngram", speculative_tree_width=4, num_speculative_tokens=4)
    for width in (1, 3, 4, 15):  # with no count given, a tree gets as many guesses as its rows fit
        config = EngineConfig.from_options(speculative_method="ngram", speculative_tree_width=width)
        assert width * config.speculative.num_speculative_tokens < 16
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig.from_options(speculative_method="ngram", speculative_tree_width=0)
    with pytest.raises(ValueError, match="early-exit needs an exit_layer"):
        EngineConfig.from_options(speculative_method="early-exit")
    with pytest.raises(ValueError, match="needs speculative_method early-exit"):
        EngineConfig.from_options(speculative_method="ngram", exit_layer=2)
    with pytest.raises(ValueError, match="not with tensor or pipeline"):
        EngineConfig.from_options(speculative_method="early-exit", exit_layer=1, pipeline_parallel_size=2)


def test_an_exit_layer_past_the_model_is_refused(folder):
    for layer in (0, 2):  # the model has two layers: only the first can draft
        with pytest.raises(ValueError, match="exit_layer must be"):
            LLM(folder, progress=False, speculative_method="early-exit", exit_layer=layer)


def test_early_exit_where_the_last_layer_adds_nothing_has_every_guess_accepted(folder, tmp_path):
    """The target with its last layer's outputs zeroed (it adds nothing to the residual stream): its
    first layer, final norm and head are the whole model, so every guess of the early exit is right,
    greedy or sampled, which holds only if the draft reads the K/V the target's first layer wrote."""
    idle = make_draft_model(folder, tmp_path / "idle", noise=0.0)
    model = load_hf_reference(idle)
    with torch.no_grad():
        model.model.layers[-1].self_attn.o_proj.weight.zero_()
        model.model.layers[-1].mlp.down_proj.weight.zero_()
    model.save_pretrained(idle, safe_serialization=True)
    llm = LLM(idle, progress=False, **speculation("early-exit", folder, None))
    prompts = [[7, 8, 9, 10, 11], [40, 3, 3, 90], [5, 6, 70]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    opted_out = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculative=False)
    outputs = llm.generate(prompts, [greedy, SamplingParams(temperature=0.8, max_tokens=12, seed=5), opted_out],
                           use_tqdm=False)
    plain = LLM(idle, progress=False).generate(prompts[::2], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[::2]] == [o.outputs[0].token_ids for o in plain]
    counts = llm.engine.spec_decode_totals
    assert counts.num_draft_tokens > 10 and counts.acceptance_rate == 1


def test_ngram_token_trees_on_the_gpu_backend_keep_greedy_tokens(folder):
    """The gpu backend's prefill kernel with tree masks (interpreted on the CPU without a GPU): prompt lookup's
    token trees of three branches give plain greedy decoding's tokens (the reference backend's), guesses of a
    branch other than the first kept in both prompts (their rows must not have seen the first branch)."""
    prompts = [[67, 191, 93, 205, 178, 243, 217] * 3, [16, 253, 7, 247, 207] * 3]  # continuations that repeat
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(folder, progress=False, device=device, backend="gpu", dtype="float32", kv_cache_memory=1 << 22,
              **speculation("ngram tree", folder, None))
    moves = []
    move = llm.engine.runner._move_kept_guesses
    llm.engine.runner._move_kept_guesses = lambda kept: moves.extend(kept) or move(kept)
    tree = llm.generate(prompts, greedy, use_tqdm=False)
    plain = LLM(folder, progress=False, backend="reference").generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tree] == [o.outputs[0].token_ids for o in plain]
    assert len([path for _, _, path in moves if path[0] != 0]) == 2


@pytest.mark.parametrize("method", ["ngram", "draft identical"])
def test_adaptive_engine_guesses_alone_and_not_when_busy(folder, unlike_draft, method):
    prompt = [7, 8, 9, 10] * 4
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(folder, progress=False, speculative_disable_by_batch_size=8,
              **(speculation(method, folder, unlike_draft) | {"speculative_adaptive": True}))
    llm.generate([prompt], greedy, use_tqdm=False)
    alone = llm.engine.spec_decode_totals.num_draft_tokens
    assert alone > 0
    llm.generate([prompt] * 8, greedy, use_tqdm=False)  # 8 running: a guess costs a whole step
    assert llm.engine.spec_decode_totals.num_draft_tokens == alone


def test_the_shipped_pair_keeps_greedy_outputs():
    """The built-in model with its draft (`builtin-draft`): greedy outputs equal plain decoding's
    on Python prompts, alone and together, and the draft's guesses are mostly right; so do
    lookahead's as published."""
    prompts = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def push(self, item):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM("builtin", progress=False).generate(prompts, params, use_tqdm=False)
    llm = LLM("builtin", progress=False, speculative_method="draft", speculative_model="builtin-draft",
              speculative_adaptive=False, num_speculative_tokens=4)  # (a fixed 8 makes more guesses past a miss)
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    expected = [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in together] == expected
    assert [o.outputs[0].token_ids for o in alone] == expected
    assert llm.engine.spec_decode_totals.acceptance_rate > 0.4
    assert llm.engine.runner.draft.block_manager.check_all_free()
    # and lookahead as published: its window's rows and pool n-grams in one token tree a step
    lookahead = LLM("builtin", progress=False, **speculation("lookahead full", None, None))
    assert [o.outputs[0].token_ids for o in lookahead.generate(prompts, params, use_tqdm=False)] == expected
    assert lookahead.engine.spec_decode_totals.num_accepted_tokens > 0


def one_call_pair(pair: str, tmp_path) -> tuple[str, str, list]:
    """A target, its draft and three prompts: the built-in pair, or q8_0 GGUFs of two unlike models."""
    from hearth.loading.convert import convert_hf_to_gguf

    if pair == "builtin":
        return "builtin", "builtin-draft", ["def fibonacci(n):", "import os\n\n\ndef list_files(path):",
                                            "class Stack:\n    def push(self, item):"]
    target, draft = (convert_hf_to_gguf(make_hf_model(tmp_path / name, "llama", seed=seed, intermediate_size=128),
                                        tmp_path / f"{name}.gguf", "q8_0", progress=False)
                     for name, seed in (("target", 0), ("draft", 1)))
    return target, draft, [[7, 8, 9, 10] * 3, [3, 5, 7, 11, 13], [40, 2, 40, 2, 9]]


def compare_one_call_with_the_loop(draft) -> tuple[list, list[int]]:
    """Make every propose of the draft runner run its passes one by one (the backend's one call
    refused), then again as they would run, and assert both choose alike. Returns the list the
    one-call kernel's results go to, and [the number of proposes] (both filled as the engine runs)."""
    backend, kernel, propose = draft.backend, draft.backend.greedy_passes, draft.propose
    reference, kernel_calls, both_calls = [False], [], [0]

    def greedy_passes(*args):
        if reference[0]:
            return None
        kernel_calls.append(kernel(*args))
        return kernel_calls[-1]

    def both(passes):
        both_calls[0] += 1
        reference[0] = True  # the passes one by one first: the same K/V written again after them
        expected = propose(passes)
        reference[0] = False
        chosen = propose(passes)
        assert chosen == expected
        return chosen

    backend.greedy_passes, draft.propose = greedy_passes, both
    return kernel_calls, both_calls


@pytest.mark.parametrize("pair", ["builtin", "q8_0"])
def test_greedy_draft_passes_run_in_one_kernel_call(tmp_path, pair):
    """A greedy chain of draft passes on the CPU's one-call path runs in one kernel call
    (cpu_kernels/decode_layers.cpp's greedy_passes): its guesses equal those of the runner's passes one by one
    on the same inputs, and at every step the draft model's own greedy continuation of the
    request's tokens. The built-in pair (F16 weights, lm_head tied to the embedding), and q8_0
    GGUFs of two unlike models (block-format embedding and lm_head; rejected guesses make the first
    pass catch up several rows). Requests near their max_tokens guess fewer: later passes on fewer rows.
    Beside a request with a repetition penalty the runner's loop runs the passes."""
    from hearth.backend.cpu import cpu_kernels
    from hearth.quant import kernels

    if kernels.extension() is None or cpu_kernels() is None:
        pytest.skip("the C++ kernels could not be built here")
    target, draft, prompts = one_call_pair(pair, tmp_path)
    llm = LLM(target, progress=False, speculative_method="draft", speculative_model=draft, speculative_adaptive=False,
              num_speculative_tokens=5)
    alone = LLM(draft, progress=False)
    kernel_calls, both_calls = compare_one_call_with_the_loop(llm.engine.runner.draft)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=24 + 4 * i, ignore_eos=True))
    # while it runs, the passes take the runner's loop (a penalty reads more than the argmax)
    engine.add_request("penalised", prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                               repetition_penalty=1.5))
    depths = set()

    def check(request) -> int:
        guesses, penalty = request.spec_token_ids, request.sampling_params.repetition_penalty
        drafted = alone.generate([request.all_token_ids], SamplingParams(
            temperature=0, max_tokens=len(guesses), ignore_eos=True, repetition_penalty=penalty), use_tqdm=False)
        assert guesses == drafted[0].outputs[0].token_ids, request.request_id
        depths.add(len(guesses))
        return 1

    assert run_checking_guesses(engine, check) >= 10 and len(depths) > 1
    assert sum(chosen is not None for chosen in kernel_calls) >= 5  # (not where the first pass is a prompt's)
    assert len(kernel_calls) < both_calls[0]  # (not with the penalised request)
    assert engine.runner.draft.block_manager.check_all_free()


class CountingPath:
    """A CpuDecodePath whose layer calls note their rows (its other calls, as greedy_passes, go to the path)."""

    def __init__(self, path, rows: list[int]):
        self.path, self.rows = path, rows

    def __call__(self, x, *rest):
        self.rows.append(x.shape[0])
        return self.path(x, *rest)

    def __getattr__(self, name: str):
        return getattr(self.path, name)


@pytest.mark.parametrize("tree_width", [1, 3])
def test_quantized_model_verifies_in_the_one_call_path(tmp_path, tree_width):
    """A GGUF with every matmul on the int8 kernel: verification steps run the CPU backend's
    one-call decode path (hearth/backend/cpu_decode.py) and give the plain engine's greedy output;
    with token trees too, branches other than the first accepted (their K/V moved into place)."""
    from hearth.backend.cpu import cpu_kernels
    from hearth.loading.convert import convert_hf_to_gguf
    from hearth.quant import kernels

    if kernels.extension() is None or cpu_kernels() is None:
        pytest.skip("the C++ kernels could not be built here")
    folder = make_hf_model(tmp_path / "llama", "llama", intermediate_size=128)  # whole q8_0 blocks
    path = convert_hf_to_gguf(folder, tmp_path / "model.gguf", "q8_0", progress=False)
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(3, 9))] * 3 for _ in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(path, progress=False)
    spec = LLM(path, progress=False, speculative_method="ngram", prompt_lookup_min=1, speculative_adaptive=False,
               speculative_tree_width=tree_width)
    model, runner = spec.engine.runner.model, spec.engine.runner
    steps, moves = [], []
    move = runner._move_kept_guesses
    runner._move_kept_guesses = lambda kept: moves.extend(kept) or move(kept)
    spec.generate([prompts[0]], greedy, use_tqdm=False)  # builds the path
    path_of_model = model.backend_state["decode_path"]
    assert path_of_model is not None
    model.backend_state["decode_path"] = CountingPath(path_of_model, steps)
    for batch in (prompts[:1], prompts):
        expected = [o.outputs[0].token_ids for o in plain.generate(batch, greedy, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in spec.generate(batch, greedy, use_tqdm=False)] == expected
    counts = spec.engine.spec_decode_totals
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    assert max(steps) > 8  # steps with verifications (more rows than sequences) took the path
    assert spec.engine.block_manager.check_all_free()
    assert (len(moves) > 0) == (tree_width > 1)
