"""Multi-token prediction as speculation (`--speculative-method mtp`, hearth/engine/mtp_draft.py) on tiny random
Qwen3.5 and Qwen3-Next models with the MTP layer their checkpoints ship (tests/models.py's add_mtp_weights): the
MTP's logits equal a reference written here from transformers' modules (the family's decoder layer and RMSNorm,
a Linear), greedy tokens equal plain decoding's, sampled ones keep its distribution, and what hearth does not run
is refused by name. (Its GGUF form, as llama.cpp's converter writes it: test_hybrid_gguf.py.)"""

from __future__ import annotations

import copy
import importlib
import json
import shutil

import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.engine_config import EngineConfig
from hearth.errors import HearthError, ModelLoadError
from hearth.loading.names import mtp_layer_count
from hearth.model_info import model_info
from models import add_mtp_weights, load_hf_reference, make_hf_model
from test_engine import random_prompts
from test_gpu_backend import DEVICE
from test_speculative import assert_same_distribution, first_tokens

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 120, 33, 64]
PROMPTS = [PROMPT, *random_prompts(2, seed=5, shortest=6, longest=30)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(a qwen3_5 folder with MTP weights, its mtp.* tensors, the same model without them)."""
    root = tmp_path_factory.mktemp("mtp")
    plain = make_hf_model(root / "plain", "qwen3_5")
    folder = root / "mtp"
    shutil.copytree(plain, folder)
    return folder, add_mtp_weights(folder), plain


@pytest.fixture(scope="module")
def engines(folders):
    """(plain decoding, speculation by the MTP layer: 3 guesses a step whatever the acceptance)."""
    folder, _, _ = folders
    return (LLM(folder, progress=False, seed=1),
            LLM(folder, progress=False, seed=2, speculative_method="mtp", num_speculative_tokens=3,
                speculative_adaptive=False))


def _reference_mtp(folder, mtp: dict[str, torch.Tensor]):
    """transformers' target model, and the MTP as vLLM's Qwen3_5MultiTokenPredictor / Qwen3NextMultiTokenPredictor
    computes it, from transformers' modules (the family's decoder layer and RMSNorm, a Linear):
    (tokens [T], hidden states [T, hidden]) -> (logits [T, V], its hidden states)."""
    model = load_hf_reference(folder)
    modeling = importlib.import_module(type(model).__module__)
    family = type(model).__name__.removesuffix("ForCausalLM")
    config = copy.deepcopy(model.config)
    config.layer_types, config._attn_implementation = ["full_attention"], "eager"
    layer = getattr(modeling, f"{family}DecoderLayer")(config, 0)
    layer.load_state_dict(_layer_state(mtp, config))
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = getattr(modeling, f"{family}RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(mtp[f"mtp.{name}.weight"])
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    fc.weight.data.copy_(mtp["mtp.fc.weight"])

    @torch.no_grad()
    def run(tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeddings = norms["pre_fc_norm_embedding"](model.model.embed_tokens(torch.tensor(tokens)))
        x = fc(torch.cat([embeddings, norms["pre_fc_norm_hidden"](hidden)], dim=-1))[None]
        positions = torch.arange(len(tokens))[None]
        if family == "Qwen3_5":  # a text token's three M-RoPE streams
            positions = positions[None].expand(3, 1, -1)
        causal = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=causal)
        out = norms["norm"](x)[0]
        return model.lm_head(out), out

    return model, run


def _layer_state(mtp: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The MTP layer's checkpoint tensors as its transformers module holds them (experts stacked: each one's
    gate and up rows in gate_up_proj [experts, 2 x width, hidden], down_proj [experts, hidden, width])."""
    state = {k.removeprefix("mtp.layers.0."): v for k, v in mtp.items() if k.startswith("mtp.layers.0.")}
    experts = range(getattr(config, "num_experts", 0))
    if experts:
        pop = [{p: state.pop(f"mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up", "down")} for e in experts]
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in pop])
        state["mlp.experts.down_proj"] = torch.stack([e["down"] for e in pop])
    return state


def _assert_mtp_logits(llm: LLM, folder, mtp: dict[str, torch.Tensor]) -> None:
    """The MTP's first pass after PROMPT reads the target's final hidden states at every prompt position with
    the token after each (the last: the token drawn), and its second feeds its guess and its own hidden state
    at the row before: both passes' logits are the reference's within 1e-4 of the largest."""
    draft = llm.engine.runner.draft
    logits, pass_logits = [], draft._pass_logits
    draft._pass_logits = lambda step, feeds: logits.append(pass_logits(step, feeds)) or logits[-1]
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        drawn = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids[0]
    finally:
        del draft._pass_logits
    model, reference = _reference_mtp(folder, mtp)
    with torch.no_grad():
        target_hidden = model.model(torch.tensor([PROMPT])).last_hidden_state[0]
    first, hidden = reference(PROMPT[1:] + [drawn], target_hidden)
    guess = int(logits[0][0].argmax())
    second, _ = reference(PROMPT[1:] + [drawn, guess], torch.cat([target_hidden, hidden[-1:]]))
    for got, want in ((logits[0][0], first[-1]), (logits[1][0], second[-1])):
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_mtp_logits_equal_a_reference_from_transformers_modules(folders, engines):
    folder, mtp, _ = folders
    _assert_mtp_logits(engines[1], folder, mtp)


def test_qwen3_next_mtp_layer_of_experts(tmp_path):
    """Qwen3-Next's MTP layer (experts and a gated shared expert, as its layers): its logits are the reference's,
    and greedy tokens with its guesses are transformers' own."""
    folder = make_hf_model(tmp_path / "qwen3_next", "qwen3_next")
    mtp = add_mtp_weights(folder)
    llm = LLM(folder, progress=False, speculative_method="mtp", num_speculative_tokens=2, speculative_adaptive=False)
    _assert_mtp_logits(llm, folder, mtp)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        want = load_hf_reference(folder).generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                                                  eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert got == want and llm.engine.spec_decode_totals.num_draft_tokens > 0


def test_greedy_tokens_are_plain_decodings(engines):
    """Greedy tokens with MTP guesses (verified, the hybrid's states rolled back after rejections) are plain
    decoding's, in a batch and for a next turn whose prefix the cache holds (the MTP reads the target's hidden
    states from the first position computed); every state slot and KV block is free afterwards."""
    plain, mtp = engines
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in mtp.generate(PROMPTS, params, use_tqdm=False)] == want
    longest = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    next_turn = PROMPTS[longest] + want[longest] + [3, 4]
    turns = [llm.generate([next_turn], params, use_tqdm=False)[0] for llm in (plain, mtp)]
    assert turns[1].num_cached_tokens > 0 and turns[1].outputs[0].token_ids == turns[0].outputs[0].token_ids
    counts = mtp.engine.spec_decode_totals
    assert counts.num_draft_tokens > 0
    assert mtp.engine.scheduler.state_slots.num_free == mtp.engine.num_state_slots
    assert mtp.engine.block_manager.num_free_blocks == mtp.engine.num_blocks


def test_sampled_tokens_keep_the_distribution(engines):
    """Unseeded draws of the first tokens, MTP against plain: one distribution (chi-square at the second to
    fourth tokens, where the MTP's guesses were verified, some kept, others not)."""
    plain, mtp = engines
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    before = mtp.engine.spec_decode_totals
    accepted, drafted = before.num_accepted_tokens, before.num_draft_tokens
    speculative = first_tokens(mtp, PROMPT, params, 200)
    counts = mtp.engine.spec_decode_totals
    assert 0 < counts.num_accepted_tokens - accepted < counts.num_draft_tokens - drafted
    assert_same_distribution(first_tokens(plain, PROMPT, params, 200), speculative, (1, 2, 3))


def test_what_hearth_does_not_run_is_refused_by_name(folders):
    """A model without an MTP layer; a checkpoint whose MTP layers are not those its config counts, or that has
    embeddings of its own; the MTP on a model split over processes."""
    _, _, plain = folders
    with pytest.raises(HearthError, match="speculative_method mtp: this qwen3_5 model has no multi-token-prediction"):
        LLM(plain, progress=False, speculative_method="mtp")
    names = ["mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"= None, and the checkpoint holds MTP layers \[0, 2\]"):
        mtp_layer_count(names, None, None, "config.json")
    with pytest.raises(ModelLoadError, match="mtp_num_hidden_layers = 2"):
        mtp_layer_count(names[:2], 2, None, "config.json")
    with pytest.raises(ModelLoadError, match="mtp_use_dedicated_embeddings = True .* is not implemented"):
        mtp_layer_count(names[:2], 1, True, "config.json")
    assert mtp_layer_count(names[:2], 1, False, "config.json") == 1
    assert mtp_layer_count(["lm_head.weight"], 1, False, "config.json") == 0
    with pytest.raises(ValueError, match="speculative_method mtp runs the model's own layers in one process"):
        EngineConfig.from_options(speculative_method="mtp", pipeline_parallel_size=2)


def test_gpu_backend_reads_the_target_hidden_states_after_a_plain_step(tmp_path):
    """On the gpu backend (Triton kernels, under the interpreter without a GPU; one state layer) a step without
    guesses runs the target's eager pass, not the decode graphs, whose replay hands on no hidden states: steps
    alternate between 2 guesses and none (the speculator's count, as the adaptive count and the speed gate's probes
    make it), and each catch-up after a plain step feeds the MTP transformers' final hidden states of the tokens
    kept (not those of a rejected guess's row); greedy tokens are transformers' own. The KV budget holds the MTP
    layer's K/V beside the target's, and `hearth inspect` names it."""
    folder = make_hf_model(tmp_path / "m", "qwen3_5", num_hidden_layers=2,
                           layer_types=["linear_attention", "full_attention"])
    add_mtp_weights(folder)
    # 2 sequences' states (each 4 times: its own, a prefix checkpoint, a snapshot per guess) and 20 blocks of K/V
    # of the target's attention layer and the MTP layer (more than a max_model_len request's 17: max_num_seqs given
    # is honoured where its states fit beside one)
    state, kv = _sizes(folder)
    llm = LLM(folder, device=DEVICE, dtype="float32", backend="gpu", progress=False, max_num_seqs=2, max_model_len=256,
              kv_cache_memory=2 * 4 * state + 20 * 16 * (kv + kv), speculative_method="mtp",
              num_speculative_tokens=2, speculative_adaptive=False)
    assert (llm.engine.num_state_slots, llm.engine.num_blocks) == (2, 20)
    assert model_info(folder, kv_element_size=4)["mtp_layers"] == {"count": 1, "kv_cache_bytes_per_token": kv}
    counts = iter([2, 0] * MAX_TOKENS)
    llm.engine.speculator._count = lambda request, num_running: next(counts)
    draft, read = llm.engine.runner.draft, []  # (first position, the target hidden states [n, hidden] read)
    catch_up = draft.catch_up

    def reading(request, num_extra):
        entry = catch_up(request, num_extra)
        if entry is not None:
            read.append((entry.num_computed_tokens, draft._first_hidden[request]))
        return entry

    draft.catch_up = reading
    got = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    model = load_hf_reference(folder)
    with torch.no_grad():
        hidden = model.model(torch.tensor([PROMPT + got])).last_hidden_state[0]
        assert got == model.lm_head(hidden[len(PROMPT) - 1 : -1]).argmax(-1).tolist()  # greedy, step by step
    assert len(read) == 2 and llm.engine.spec_decode_totals.num_draft_tokens > 0
    for start, rows in read:
        assert torch.allclose(rows.cpu(), hidden[start : start + len(rows)], atol=1e-4)


def _sizes(folder) -> tuple[int, int]:
    """From the config's shapes, float32 bytes of a Gated DeltaNet layer's state per sequence (its convolution
    window, kernel - 1 inputs of q, k and v, and its delta rule's [value heads, key dim, value dim]) and of an
    attention layer's K and V per token (kv heads x head_dim each)."""
    config = json.loads((folder / "config.json").read_text())
    conv_width = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"] + \
        config["linear_num_value_heads"] * config["linear_value_head_dim"]
    state = (config["linear_conv_kernel_dim"] - 1) * conv_width + \
        config["linear_num_value_heads"] * config["linear_key_head_dim"] * config["linear_value_head_dim"]
    return 4 * state, 4 * 2 * config["num_key_value_heads"] * config["head_dim"]
