"""Hybrid models, layers that keep a state per sequence between attention layers: lfm2 (short
convolutions), qwen3_5 (Gated DeltaNet, gated attention with partial RoPE), qwen3_next (the same layers,
projections fused per key head, experts with a gated shared expert), granitemoehybrid (Mamba2,
attention without RoPE, experts and a shared MLP, multipliers) and nemotron_h (blocks of Mamba2, attention,
a relu2 MLP or experts routed by sigmoid), against transformers
on tiny random models in the real layer structure (tests/models.py): greedy tokens and top-5
logprobs at batch 1 and in a mixed batch with chunked prefill and forced preemption, a second
request sharing a prefix, the state cache's sizes and bookkeeping, and what is refused by name."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.engine.kv_cache import BlockManager
from hearth.engine.request import Request, RequestStatus
from hearth.engine.runner import BatchEntry, ModelRunner
from hearth.engine.scheduler import Scheduler
from hearth.engine.state_slots import StateCheckpoints, StateSlots
from hearth.errors import HearthError, ModelLoadError, RequestError
from hearth.loading.convert import convert_hf_to_gguf
from hearth.loading.gguf_reader import read_gguf
from hearth.loading.loader import load_model
from hearth.model_info import model_info
from models import VOCAB_SIZE, load_hf_reference, make_hf_model
from test_engine import random_prompts

MAX_TOKENS = 8
SHARED = random_prompts(1, seed=11, shortest=40, longest=40)[0]  # a prefix of two and a half blocks
PROMPTS = [*random_prompts(3, seed=5, shortest=6, longest=45), SHARED + [3, 4, 5], SHARED + [7, 8]]
# per family: (state layers' bytes per sequence in float32, attention layers' K/V bytes per token in float32),
# from the shapes in tests/models.py: lfm2's two convolutions keep 64 channels x (3 - 1) inputs; qwen3_5's
# (and qwen3_next's) three Gated DeltaNet layers keep (2 x 2 x 8 + 4 x 12) channels x (4 - 1) inputs and 4 heads
# of 8 x 12;
# the two Mamba2 layers of granitemoehybrid and nemotron_h keep (x + B + C of 2 groups x 8) channels x (4 - 1)
# inputs, x of 4 heads of 32 and 16, and 4 heads of 8 x 32 and 8 x 16;
# each family's one attention layer keeps 2 x 2 KV heads x 16 per token
SIZES = {"lfm2": (2 * 64 * 2 * 4, 2 * 2 * 16 * 4),
         "qwen3_5": (3 * ((2 * 2 * 8 + 4 * 12) * 3 + 4 * 8 * 12) * 4, 2 * 2 * 16 * 4),
         "qwen3_next": (3 * ((2 * 2 * 8 + 4 * 12) * 3 + 4 * 8 * 12) * 4, 2 * 2 * 16 * 4),
         "granitemoehybrid": (2 * ((4 * 32 + 2 * 2 * 8) * 3 + 4 * 8 * 32) * 4, 2 * 2 * 16 * 4),
         "nemotron_h": (2 * ((4 * 16 + 2 * 2 * 8) * 3 + 4 * 8 * 16) * 4, 2 * 2 * 16 * 4)}


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5", "qwen3_next", "granitemoehybrid", "nemotron_h"])
def family(request, tmp_path_factory):
    """(architecture, folder, transformers' greedy tokens and per token its top-5 {id: logprob} for PROMPTS)."""
    arch = request.param
    folder = make_hf_model(tmp_path_factory.mktemp(arch) / "m", arch)
    return arch, folder, transformers_greedy_with_top5(folder, PROMPTS, MAX_TOKENS)


def transformers_greedy_with_top5(folder, prompts: list[list[int]], max_tokens: int) -> list:
    """Per prompt: transformers' greedy tokens and per token its top-5 {id: logprob}."""
    model, expected = load_hf_reference(folder), []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 output_logits=True, return_dict_in_generate=True)
            top = [dict(zip(*reversed(torch.log_softmax(step[0].float(), -1).topk(5)))) for step in out.logits]
            expected.append((out.sequences[0, len(prompt):].tolist(),
                             [{int(i): float(lp) for i, lp in position.items()} for position in top]))
    return expected


def _greedy_with_top5(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate(PROMPTS, params, use_tqdm=False)


def check_greedy_with_top5(outputs, expected) -> None:
    """Greedy tokens equal transformers'; at each position the top 5 are its ids with its logprobs (1e-4)."""
    for output, (tokens, top) in zip(outputs, expected):
        sample = output.outputs[0]
        assert sample.token_ids == tokens
        for ours, theirs in zip(sample.logprobs, top):
            ours = {i: (lp.logprob if hasattr(lp, "logprob") else lp) for i, lp in ours.items()}
            assert set(theirs) <= set(ours)
            for token, logprob in theirs.items():
                assert ours[token] == pytest.approx(logprob, abs=1e-4)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_one_at_a_time_matches_transformers(family, backend):
    """Batch 1 (max_num_seqs 1): each prompt computed alone. With prefix caching (cpu) the request sharing
    SHARED with the one before starts from its state checkpoint at the end of the other's prompt's last
    full block (32 tokens); without it (reference) nothing is reused. Either way transformers' tokens."""
    arch, folder, expected = family
    caching = backend == "cpu"
    llm = LLM(folder, backend=backend, max_num_seqs=1, enable_prefix_caching=caching, progress=False)
    assert llm.engine.num_state_checkpoints == (1 if caching else 0)
    outputs = _greedy_with_top5(llm)
    check_greedy_with_top5(outputs, expected)
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 0, 32 if caching else 0]
    assert llm.engine.block_manager.prefix_cache_hits == (32 if caching else 0)
    assert llm.engine.scheduler.state_slots.num_free == llm.engine.num_state_slots == 1
    if not caching:
        with pytest.raises(RequestError, match=f"needs prefix caching on a hybrid model \\({arch}"):
            llm.engine.export_kv(PROMPTS[0])


def test_kv_transfer_carries_the_state_checkpoint(family):
    """Disaggregated prefill's transfer: a prefill engine's K/V of a prompt's full blocks up to its state
    checkpoint (32 of SHARED + [3, 4, 5]'s 43 tokens) and that checkpoint's states, entered into a decode
    engine, whose request with the prompt starts after them and gives transformers' tokens and logprobs;
    states that do not fit the model are refused by name."""
    arch, folder, expected = family
    prefill, decode = LLM(folder, progress=False), LLM(folder, progress=False)
    prompt = PROMPTS[3]
    prefill.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    tensors = prefill.engine.export_kv(prompt)
    assert tensors["kv"].shape[2] == 32 and set(tensors) - {"kv"} == set(decode.engine.runner.state_tensors())
    with pytest.raises(RequestError, match="do not fit this engine's state layers"):
        decode.engine.import_kv(prompt, {**tensors, next(iter(set(tensors) - {"kv"})): torch.zeros(3)})
    assert decode.engine.import_kv(prompt, tensors) == 32
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    output = decode.generate([prompt], params, use_tqdm=False)[0]
    assert output.num_cached_tokens == 32
    check_greedy_with_top5([output], [expected[3]])


def test_prefix_cache_restores_state_checkpoints(family):
    """A long prefix shared: the second request starts from the first's checkpoint at the end of its
    prompt's last full block (96 of 100 shared tokens) and computes only its tail; a request that parts
    from them at token 70 finds their K/V up to 64 but no state there, computes from 0 and leaves a
    checkpoint at that junction, from which the next one sharing 70 tokens starts. Every first token's
    top-5 logprobs and greedy tokens equal transformers' on the whole prompt."""
    arch, folder, _ = family
    long = random_prompts(1, seed=12, shortest=100, longest=100)[0]
    prompts = [long + [3, 4, 5], long + [7, 8], long[:70] + [9], long[:70] + [10, 11]]
    llm = LLM(folder, max_num_seqs=2, progress=False)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    outputs, computed = [], []
    for prompt in prompts:  # one at a time, so that each finds what the ones before left
        outputs += llm.generate([prompt], params, use_tqdm=False)
        computed.append(len(prompt) - outputs[-1].num_cached_tokens)
    assert [o.num_cached_tokens for o in outputs] == [0, 96, 0, 64] and computed == [103, 6, 71, 8]
    reference = load_hf_reference(folder)
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs):
            ids = torch.tensor([prompt])
            theirs = torch.log_softmax(reference(ids).logits[0, -1].float(), -1)
            tokens = reference.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0,
                                        attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
            sample = output.outputs[0]
            assert sample.token_ids == tokens
            assert set(theirs.topk(5).indices.tolist()) <= set(sample.logprobs[0])
            for token, logprob in sample.logprobs[0].items():
                assert logprob == pytest.approx(theirs[token].item(), abs=1e-4)


def test_perplexity_windows_each_in_a_state_slot(family):
    """hearth perplexity's windows, several in one pass, each from a zero state in its own slot: the
    mean negative log-likelihood transformers gives each window, averaged over their tokens."""
    from hearth.perplexity import perplexity

    arch, folder, _ = family
    tokens = PROMPTS[0] + PROMPTS[1] + PROMPTS[2]  # 92 tokens: windows of 40, 40 and 12
    model = load_model(folder, progress=False).model
    ours = perplexity(model, tokens, context=40, device=torch.device("cpu"), max_batch_tokens=120)
    reference, total, count = load_hf_reference(folder), 0.0, 0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, 40):
            window = torch.tensor([tokens[start:start + 40]])
            logits = reference(window).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
            count += window.shape[1] - 1
    assert ours["tokens"] == count and ours["nll"] == pytest.approx(total / count, rel=1e-5)


def test_mixed_batch_chunked_prefill_and_preemption(family):
    """Every prompt at once in 16-token steps (prompts in chunks beside decodes), 4 state slots for 5
    requests and a KV cache of 5 blocks, fewer than they need together (preemption, re-prefill), with
    prefix caching: a state checkpoint per slot from the same budget. (max_num_seqs given: honoured where
    the budget holds its states beside one max_model_len request, 64 tokens: 5 blocks with the token after.)"""
    arch, folder, expected = family
    state_bytes, kv_bytes = SIZES[arch]
    llm = LLM(folder, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, progress=False,
              kv_cache_memory=4 * 2 * state_bytes + 5 * 16 * kv_bytes)
    engine = llm.engine
    assert (engine.num_state_slots, engine.num_state_checkpoints, engine.num_blocks) == (4, 4, 5)
    outputs = _greedy_with_top5(llm)
    check_greedy_with_top5(outputs, expected)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert engine.block_manager.prefix_cache_hits > 0  # preempted requests restarted from their checkpoints
    assert engine.block_manager.check_all_free() and engine.scheduler.state_slots.num_free == 4


def test_states_hold_what_transformers_cache_holds(family):
    """After a prompt in two chunks, a state layer's slot holds transformers' cache of that layer: a
    convolution's last inputs (transformers keeps one more, the oldest) and the delta rule's state."""
    arch, folder, _ = family
    model = load_model(folder, progress=False).model
    runner = ModelRunner(model, 4, 16, torch.device("cpu"), torch.float32, num_state_slots=3)
    prompt = PROMPTS[0]
    runner.forward([BatchEntry(prompt[:5], 0, [2, 0, 1, 3], state_slot=1)])
    runner.forward([BatchEntry(prompt[5:], 5, [2, 0, 1, 3], state_slot=1)])
    with torch.no_grad():
        cache = load_hf_reference(folder)(torch.tensor([prompt]), use_cache=True).past_key_values
    window = model.config.conv_kernel_size - 1
    for layer, states in enumerate(runner.kv_caches):
        if model.config.layer_type(layer) in ("attention", "mlp"):
            continue
        conv = cache.get_conv_state(layer, state_idx=0)[0, :, -window:]
        torch.testing.assert_close(states[0][1], conv, rtol=1e-5, atol=1e-5)
        if len(states) > 1:  # (transformers keeps Mamba2's as [heads, head dim, state size])
            theirs = cache.get_recurrent_state(layer, state_idx=0)[0]
            ours = states[1][1].transpose(-1, -2) if model.config.layer_type(layer) == "mamba2" else states[1][1]
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_inspect_gives_state_and_kv_sizes(family):
    arch, folder, _ = family
    state_bytes, kv_bytes = SIZES[arch]
    # a sequence of the model's whole context (512 tokens, and the one sampled after: 33 blocks of 16) with its
    # states and a prefix-cache checkpoint's (prefix caching is on by default): three of them, and 100 tokens more
    sequence = 2 * state_bytes + 33 * 16 * kv_bytes
    budget = 3 * sequence + 100 * kv_bytes
    info = model_info(folder, kv_budget_bytes=budget, kv_element_size=4)
    assert info["kv_cache_bytes_per_token"] == kv_bytes
    assert info["state_layers"]["state_bytes_per_sequence"] == state_bytes
    assert info["kv_budget_sequences"] == info["kv_budget_state_checkpoints"] == 3
    assert info["kv_budget_state_checkpoint_bytes"] == 3 * state_bytes
    assert info["kv_budget_tokens"] == 3 * 33 * 16 + 100 and "512-token requests" in info["kv_budget_why"]


def test_contrastive_refused_by_name(family):
    """(Speculation's refusals: test_hybrid_speculation.py.)"""
    arch, folder, _ = family
    with pytest.raises(HearthError, match=f"contrastive_model is not implemented for a hybrid model \\({arch}"):
        LLM(folder, contrastive_model=str(folder), progress=False)
    llm = LLM(folder, progress=False)
    with pytest.raises(RequestError, match=f"contrastive search \\(penalty_alpha\\) is not implemented for a hybrid "
                                           f"model \\({arch}"):
        llm.generate([[1, 2, 3]], SamplingParams(penalty_alpha=0.5, top_k=4), use_tqdm=False)


def test_scheduler_counts_state_slots():
    """No tensors: a request is admitted only with a free state slot, gives it back when preempted
    (recomputed from position 0 later) and when it finishes."""
    scheduler = Scheduler(BlockManager(3, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64,
                          state_slots=StateSlots(2))
    requests = [Request(str(i), [1, 2, 3]) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert [r for r, _ in out.scheduled] == requests[:2]  # a block is free, but no slot: the third waits
    assert sorted(r.state_slot for r in requests[:2]) == [0, 1] and requests[2].state_slot == -1
    scheduler.update_after_step(out)
    for _ in range(6):  # 9 tokens: three blocks, of which one is free
        requests[0].append_output_token(9)
    out = scheduler.schedule()
    assert out.preempted == [requests[1]] and (requests[1].state_slot, requests[1].num_computed_tokens) == (-1, 0)
    assert scheduler.state_slots.num_free == 1 and requests[1] is scheduler.waiting[0]
    scheduler.finish_request(requests[0], RequestStatus.FINISHED_STOPPED)
    assert requests[0].state_slot == -1 and scheduler.state_slots.num_free == 2
    out = scheduler.schedule()
    assert [r for r, _ in out.scheduled] == requests[1:] and scheduler.state_slots.num_free == 0


def test_state_checkpoints_live_and_die_with_their_blocks():
    """No tensors: a hybrid request's steps end at its checkpoint boundaries (every 2 blocks here, and its
    prompt's last full block), each followed by a save the runner is asked for; a third checkpoint takes
    the least recently used one's slot; a request sharing the prompt starts from the last checkpoint with
    a restore; a block evicted takes its checkpoint with it, so that the next lookup stops short of it."""
    checkpoints = StateCheckpoints(first_slot=2, count=2, interval_blocks=2)
    bm = BlockManager(7, 4, checkpoints=checkpoints)
    scheduler = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, state_slots=StateSlots(2))

    def step(request):
        out = scheduler.schedule()
        scheduler.update_after_step(out)
        return [n for r, n in out.scheduled if r is request], checkpoints.take_moves()

    def content_ids(*tokens):  # the cached blocks' content ids, by the tokens that end them
        ids = {bm.blocks[i].key[1][-1]: bm.blocks[i].content_id for i in bm.cached.values()}
        return {ids.get(t) for t in tokens}

    prompt = list(range(1, 23))  # 22 tokens: its last full block short of the last token ends at 20
    a = Request("a", prompt)
    scheduler.add_request(a)
    assert [step(a) for _ in range(4)] == [([8], [(0, 2)]), ([8], [(0, 3)]), ([4], [(0, 2)]), ([2], [])]
    assert set(checkpoints) == content_ids(16, 20)  # the one at 8 gave its slot to the one at 20
    scheduler.finish_request(a, RequestStatus.FINISHED_STOPPED)
    b = Request("b", prompt + [99])
    scheduler.add_request(b)
    assert step(b) == ([3], [(2, b.state_slot)]) and b.num_cached_tokens == 20
    scheduler.finish_request(b, RequestStatus.FINISHED_STOPPED)
    assert bm.allocate_slots(other := Request("x", [77] * 12), 12)  # evicts the blocks freed last: 24, then 20
    assert set(checkpoints) == content_ids(16) and None not in content_ids(12, 16)
    bm.free(other)
    c = Request("c", prompt + [98])
    scheduler.add_request(c)
    # from 16, not 20 (its block is gone); and after the step its state at 20 is saved again
    assert step(c) == ([4], [(3, c.state_slot), (c.state_slot, 2)]) and c.num_cached_tokens == 16
    assert all(cid in {bm.blocks[i].content_id for i in bm.cached.values()} for cid in checkpoints)


REFUSED = {  # per family: config.json fields hearth does not implement, and what the error says
    "qwen3_5": [({"hidden_act": "gelu"}, "hidden_act='gelu' is not implemented by hearth for qwen3_5"),
                ({"text_config": "none"}, "text_config = 'none': expected an object"),
                ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
                ({"layer_types": ["linear_attention"] * 4}, "models with an attention layer")],
    "qwen3_next": [({"hidden_act": "gelu"}, "hidden_act='gelu' is not implemented by hearth for qwen3_next"),
                   ({"linear_value_head_dim": 16}, "in_proj_qkvz.weight: shape \\(128, 64\\), expected 160 rows")],
    "lfm2": [({"layer_types": ["conv", "sliding_attention", "conv"]}, "expected full_attention or conv"),
             ({"conv_L_cache": 1}, "convolutions of 2 taps or more")],
    "granitemoehybrid": [({"hidden_act": "gelu"}, "hidden_act='gelu' is not implemented by hearth for granitemoehybrid"),
                         ({"layer_types": ["mamba"] * 3}, "models with an attention layer"),
                         ({"mamba_n_groups": 3}, "mamba_num_heads \\(4\\) is not a multiple of the 3 groups")],
    "nemotron_h": [({"layers_block_type": ["mamba", "mlp", "attention", "moe", "linear"]},
                    "does not implement nemotron_h's other kinds"),
                   ({"n_group": 2, "topk_group": 1}, "n_group=2 is not implemented"),
                   ({"mamba_hidden_act": "relu"}, "mamba_hidden_act='relu' is not implemented"),
                   ({"moe_latent_size": 16}, "moe_latent_size=16 is not implemented")],
}


def test_unimplemented_fields_refused_by_name(family, tmp_path):
    arch, folder, _ = family
    for i, (fields, message) in enumerate(REFUSED[arch]):
        copy = tmp_path / str(i)
        copy.mkdir()
        config = {**json.loads((folder / "config.json").read_text()), **fields}
        (copy / "config.json").write_text(json.dumps(config))
        for file in folder.iterdir():
            if file.name != "config.json":
                (copy / file.name).symlink_to(file)
        with pytest.raises(ModelLoadError, match=message):
            load_model(copy, progress=False)


def test_lfm2_biases_in_gguf_refused_by_name(tmp_path):
    """`hearth convert` of an lfm2 with convolution biases (llama.cpp's lfm2 has no tensors for them). (The
    other hybrids' GGUF: tests/test_hybrid_gguf.py; the gpu backend's state layers: tests/test_gpu_backend.py.)"""
    folder = make_hf_model(tmp_path / "m", "lfm2")
    with pytest.raises(ModelLoadError, match="lfm2 with conv_bias"):
        convert_hf_to_gguf(folder, tmp_path / "m.gguf", "f32", progress=False)


def test_lfm2_gguf_round_trip(tmp_path):
    """`hearth convert` writes lfm2 as llama.cpp names it (every tensor one of gguf-py's LFM2 tensors, a
    KV head count per layer, the convolution's taps); read back, its logits equal transformers' (f32),
    and a q8_0 file generates as the folder does up to its rounding."""
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    folder = make_hf_model(tmp_path / "m", "lfm2", conv_bias=False)
    path = convert_hf_to_gguf(folder, tmp_path / "m.gguf", "f32", progress=False)
    file = read_gguf(path)
    names = {TENSOR_NAMES[t].format(bid=b) + ".weight" for t in MODEL_TENSORS[MODEL_ARCH.LFM2] for b in range(3)}
    assert {t.name for t in file.tensors} <= names
    assert list(file.metadata["lfm2.attention.head_count_kv"]) == [0, 2, 0]
    assert file.metadata["lfm2.shortconv.l_cache"] == 3
    model = load_model(path, progress=False).model
    assert model.config.layer_types == ("short_conv", "attention", "short_conv")
    runner = ModelRunner(model, 4, 16, torch.device("cpu"), torch.float32, num_state_slots=1)
    hidden, _ = runner.forward([BatchEntry(PROMPTS[0], 0, [3, 1, 0, 2], state_slot=0)])
    with torch.no_grad():
        want = load_hf_reference(folder)(torch.tensor([PROMPTS[0]])).logits[0]
    got = model.compute_logits(hidden)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    quantized = convert_hf_to_gguf(folder, tmp_path / "q.gguf", "q8_0", progress=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ours = LLM(quantized, progress=False).generate(PROMPTS[:2], params, use_tqdm=False)
    theirs = LLM(folder, progress=False).generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]


def test_qwen3_5_image_text_folder_runs_its_text_model(tmp_path, caplog):
    """A Qwen3.5 checkpoint as released (Qwen3_5ForConditionalGeneration: the text model under
    text_config and model.language_model, a vision tower beside it): hearth loads both (nothing left
    out; images: tests/test_vision_qwen.py) and gives transformers' logits for a text prompt."""
    import transformers

    from models import hf_config, make_tokenizer

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    reference = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=hf_config("qwen3_5").to_dict(), vision_config=vision,
                                   image_token_id=300, video_token_id=301)).eval()  # (tokens of the tiny vocabulary)
    reference.save_pretrained(tmp_path)
    make_tokenizer(tmp_path)
    with caplog.at_level(logging.INFO, logger="hearth"):
        model = load_model(tmp_path, progress=False).model
    assert "tensors not loaded" not in caplog.text and model.vision is not None
    runner = ModelRunner(model, 4, 16, torch.device("cpu"), torch.float32, num_state_slots=1)
    hidden, _ = runner.forward([BatchEntry(PROMPTS[0], 0, [0, 1, 2, 3], state_slot=0)])
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([PROMPTS[0]])).logits[0]
    got = model.compute_logits(hidden)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_granite_dense_with_rope_and_nemotron_h_older_config(tmp_path):
    """Granite 4.0-H's other shapes: no experts (the shared MLP is the layer's MLP) and RoPE on (position_embedding_type
    rope): transformers' logits over a prompt and a decode. A nemotron_h config.json in its older names
    (hybrid_override_pattern, mamba_n_groups, mamba_d_conv) reads as transformers reads it, its
    sliding_window unused as there."""
    import transformers

    from hearth.config import ModelConfig

    folder = make_hf_model(tmp_path / "g", "granitemoehybrid", num_local_experts=0, position_embedding_type="rope")
    model = load_model(folder, progress=False).model
    assert model.config.no_rope_layers == () and model.config.num_experts == 0
    runner = ModelRunner(model, 4, 16, torch.device("cpu"), torch.float32, num_state_slots=1)
    prompt = PROMPTS[0]
    hidden = torch.cat([runner.forward([BatchEntry(prompt[:-1], 0, [0, 1, 2, 3], state_slot=0)])[0],
                        runner.forward([BatchEntry(prompt[-1:], len(prompt) - 1, [0, 1, 2, 3], state_slot=0)])[0]])
    with torch.no_grad():
        want = load_hf_reference(folder)(torch.tensor([prompt])).logits[0]
    got = model.compute_logits(hidden)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    older = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": VOCAB_SIZE,
             "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8,
             "hybrid_override_pattern": "M-M*-", "mamba_n_groups": 2, "mamba_d_conv": 3, "sliding_window": 8}
    theirs = transformers.NemotronHConfig(**older)
    ours = ModelConfig.from_hf(older)
    assert [{"mamba2": "linear_attention", "attention": "full_attention"}.get(kind, kind) for kind in ours.layer_types] \
        == theirs.layers_block_type
    assert (ours.mamba_groups, ours.conv_kernel_size) == (theirs.n_groups, theirs.conv_kernel) == (2, 3)
    assert ours.sliding_window is None  # (transformers' nemotron_h attends to the whole context whatever it says)


def test_cpu_kernels_match_the_torch_steps():
    """cpu_kernels/state_ops.cpp's decode steps (convolution, delta rule, Mamba2's scan) against the reference
    backend's torch ones, in a step of three decodes (one starting fresh, its slot holding another
    sequence's old state) and a chunk."""
    from hearth.backend.base import Backend
    from hearth.backend.cpu import CpuBackend
    from hearth.backend.state_ops import StateMetadata

    slots, starts, seq_lens = np.array([4, 1, 5, 2]), np.array([0, 1, 2, 7, 8]), np.array([9, 1, 12, 30])
    meta = StateMetadata.from_step(slots, starts, seq_lens, torch.device("cpu"))
    rows, channels, taps, heads, dk, dv = 8, 24, 4, 3, 8, 12
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    x, weight, bias, windows = randn(rows, channels), randn(channels, taps), randn(channels), randn(6, channels, taps - 1)
    q, k = (torch.nn.functional.normalize(randn(rows, heads, dk), dim=-1) for _ in range(2))
    v, g, beta, states = randn(rows, heads, dv), -randn(rows, heads).abs(), randn(rows, heads).sigmoid(), \
        randn(6, heads, dk, dv)
    results = []
    for backend in (Backend(), CpuBackend()):
        conv_states, delta_states, ssm_states = windows.clone(), states.clone(), states.clone()
        results.append([backend.causal_conv1d(x, conv_states, weight, b, meta, "silu") for b in (bias, None)]
                       + [conv_states, backend.gated_delta_rule(q, k, v, g, beta, delta_states, meta), delta_states,
                          backend.ssm_scan(q, k, v, g, ssm_states, meta), ssm_states])
    for theirs, ours in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiled", [False, True])
def test_gated_delta_net_step_matches_the_layers_torch_ops(tiled):
    """cpu_kernels/state_ops.cpp's gated_delta_net_step (a decode step's whole Gated DeltaNet layer between its
    projections) against the layer's torch ops on the reference backend, in a step of three decodes (one
    starting fresh, its slot holding another sequence's old states), each value head reading its key head in
    runs (qwen3_5) or tiled (a GGUF's order): outputs and both states. A step with a chunk is declined."""
    import dataclasses

    from hearth.backend.base import Backend
    from hearth.backend.cpu import CpuBackend
    from hearth.backend.state_ops import StateMetadata
    from hearth.config import ModelConfig
    from hearth.model.state_layers import GatedDeltaNet
    from models import hf_config

    config = dataclasses.replace(ModelConfig.from_hf(hf_config("qwen3_5").to_dict()), linear_value_heads_tiled=tiled)
    layer = GatedDeltaNet(config, Backend())
    generator = torch.Generator().manual_seed(0)
    for weight in (layer.conv1d.weight, layer.dt_bias, layer.A_log, layer.norm.weight):
        weight.copy_(torch.randn(weight.shape, generator=generator))
    keys, values, heads = 2 * 8, 4 * 12, 4  # hf_config's 2 key heads of 8, 4 value heads of 12
    # in_proj's outputs, as a merged projection's views of one tensor
    qkv, z, b, a = torch.randn(3, 2 * keys + 2 * values + 2 * heads, generator=generator).split(
        [2 * keys + values, values, heads, heads], dim=-1)
    meta = StateMetadata.from_step(np.array([4, 1, 5]), np.array([0, 1, 2, 3]), np.array([9, 1, 12]), torch.device("cpu"))
    states = (torch.randn(6, 2 * keys + values, 3, generator=generator), torch.randn(6, heads, 8, 12, generator=generator))
    theirs = [t.clone() for t in states]
    expected = layer._mix(qkv, z, b, a, theirs, meta)
    ours = [t.clone() for t in states]
    torch.testing.assert_close(CpuBackend().gated_delta_net_step(layer, qkv, z, b, a, ours, meta), expected,
                               rtol=1e-5, atol=1e-5)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    chunk = StateMetadata.from_step(np.array([4, 1]), np.array([0, 1, 3]), np.array([9, 2]), torch.device("cpu"))
    assert CpuBackend().gated_delta_net_step(layer, qkv, z, b, a, ours, chunk) is None


def test_qwen3_next_experts_where_transformers_puts_them():
    """qwen3_next's experts in the layers transformers builds them in: every decoder_sparse_step-th layer but
    those of mlp_only_layers (a dense MLP of intermediate_size there)."""
    import transformers

    from hearth.config import ModelConfig
    from models import hf_config

    theirs = hf_config("qwen3_next", num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3])
    with torch.device("meta"):
        layers = transformers.Qwen3NextForCausalLM(theirs).model.layers
    ours = ModelConfig.from_hf(theirs.to_dict())
    assert [ours.is_moe_layer(i) for i in range(8)] == [hasattr(layer.mlp, "experts") for layer in layers] \
        == [False, True, False, False, False, True, False, True]
