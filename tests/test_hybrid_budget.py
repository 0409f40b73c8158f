"""How a hybrid model's KV budget is shared between its states and K/V (hearth/engine/memory.py,
split_budget): first one state slot and K/V for one max_model_len request, then as many sequences as
the budget holds max_model_len requests with their states (at most 256), or max_num_seqs as given where
its states fit beside one max_model_len request, else refused by name. Every figure is arithmetic on
the shapes written here, not the engine's own sums."""

from __future__ import annotations

import dataclasses

import pytest

from hearth import LLM, SamplingParams
from hearth.bench.models import ARCHS, write_hf_folder
from hearth.cli import main
from hearth.config import ModelConfig
from hearth.engine.memory import split_budget
from hearth.errors import HearthError
from hearth.model_info import model_info

GIB, MIB = 1 << 30, 1 << 20


def _blocks(tokens: int) -> int:
    """Blocks of 16 for a request of `tokens` tokens and the one sampled after it."""
    return -(-(tokens + 1) // 16)


def test_qwen3_5_0_8b_budget_of_1_gib():
    """Qwen3.5-0.8B's shapes (its release config): 18 Gated DeltaNet layers keep 16 heads of 128 x 128 and a
    conv window of 3 inputs of 2 x 16 x 128 + 16 x 128 channels, 6 attention layers 2 KV heads of 256, all float32
    here. The old split gave 1 GiB 26 states and 944 tokens of K/V; now a 2,000-token request fits."""
    config = ModelConfig.from_hf(ARCHS["qwen3.5-0.8b"].hf_config())
    state = 18 * (16 * 128 * 128 + 3 * (2 * 16 * 128 + 16 * 128)) * 4  # 19.3 MiB a sequence
    kv = 6 * 2 * 2 * 256 * 4  # 24 KiB a token
    assert (config.state_bytes_per_sequence(4), config.kv_bytes_per_token(4)) == (state, kv)
    slot = 2 * state  # with prefix caching, a checkpoint's beside each sequence's own
    # the model's whole context (262,144 tokens, 6 GiB of K/V) does not fit: one sequence, K/V all the rest
    split = split_budget(GIB, kv, 16, 262144, slot, None)
    assert (split.state_slots, split.kv_bytes) == (1, GIB - slot) and (GIB - slot) // kv >= 2000
    # 4,096-token requests: seven of them with their states (134.5 MiB each), each able to reach 4,096 tokens
    split = split_budget(GIB, kv, 16, 4096, slot, None)
    assert split.state_slots == GIB // (slot + _blocks(4096) * 16 * kv) == 7
    assert split.kv_bytes == GIB - 7 * slot and split.kv_bytes >= 7 * _blocks(4096) * 16 * kv
    # max_num_seqs given: as many states as fit beside one 4,096-token request (24), refused past that, by name
    most = (GIB - _blocks(4096) * 16 * kv) // slot
    assert most == 24 and split_budget(GIB, kv, 16, 4096, slot, most).kv_bytes == GIB - most * slot
    with pytest.raises(HearthError, match="max_num_seqs 25: kv_cache_memory 1.00 GiB holds the states of at most 24 "
                                          "sequences .* beside K/V for one 4,096-token request"):
        split_budget(GIB, kv, 16, 4096, slot, 25)
    # a budget for many short requests: at most the default 256 sequences
    assert split_budget(64 * GIB, kv, 16, 64, slot, None).state_slots == 256
    with pytest.raises(HearthError, match="holds not even one sequence's states"):
        split_budget(slot, kv, 16, 4096, slot, None)


def test_engine_serves_a_long_request_and_inspect_says_why(tmp_path, capsys):
    """Qwen3.5-0.8B's layer pattern (three Gated DeltaNet layers, then an attention layer) at a tiny width and a
    context of 2,048 tokens, random weights (hearth bench make-model's writer), and a budget of 2 MiB, where the
    old split kept 55 states and 932 tokens of K/V: now three sequences of 2,048 tokens and the rest K/V; a
    2,000-token prompt runs; `hearth inspect` says the same and why; too many sequences asked are refused."""
    spec = dataclasses.replace(ARCHS["qwen3.5-0.8b"], vocab_size=1024, hidden_size=64, intermediate_size=64,
                               num_layers=4, num_heads=4, num_kv_heads=2, max_position_embeddings=2048,
                               bos_token_id=1000, eos_token_id=1001, extra={
                                   **ARCHS["qwen3.5-0.8b"].extra, "head_dim": 16, "linear_key_head_dim": 16,
                                   "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4})
    folder = write_hf_folder(spec, tmp_path / "m", progress=False)
    # per Gated DeltaNet layer a conv window of 3 inputs of 2 x 2 x 16 + 4 x 16 channels and 4 heads of 16 x 16;
    # per token 2 x 2 KV heads of 16; float32; prefix caching keeps a checkpoint beside each sequence's states
    slot = 2 * 3 * (3 * (2 * 2 * 16 + 4 * 16) + 4 * 16 * 16) * 4
    kv = 2 * 2 * 16 * 4
    budget, context = 2 * MIB, _blocks(2048) * 16 * kv
    slots = budget // (slot + context)
    blocks = (budget - slots * slot) // (16 * kv)
    assert (slots, blocks) == (3, 487)

    llm = LLM(folder, kv_cache_memory=budget, progress=False)
    engine = llm.engine
    assert (engine.num_state_slots, engine.num_blocks, engine.max_num_seqs) == (slots, blocks, slots)
    assert slots * slot + blocks * 16 * kv <= budget
    output = llm.generate([[(7 * i) % 900 + 3 for i in range(2000)]],
                          SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 2 and output.outputs[0].finish_reason == "length"
    assert engine.block_manager.check_all_free() and engine.scheduler.state_slots.num_free == slots

    info = model_info(folder, kv_budget_bytes=budget, kv_element_size=4)
    assert (info["kv_budget_sequences"], info["kv_budget_tokens"]) == (slots, (budget - slots * slot) // kv)
    most = (budget - context) // slot
    assert model_info(folder, kv_budget_bytes=budget, kv_element_size=4, max_num_seqs=most)["kv_budget_sequences"] == most
    assert main(["inspect", str(folder), "--kv-budget", "2MiB", "--kv-bytes-per-element", "4"]) == 0
    assert "sequences        3: as many as the budget holds 2,048-token requests with their states" in \
        capsys.readouterr().out
    assert main(["inspect", str(folder), "--kv-budget", "2MiB", "--kv-bytes-per-element", "4",
                 "--max-num-seqs", str(most + 1)]) == 1
    assert f"max_num_seqs {most + 1}: kv_cache_memory 2.0 MiB holds the states of at most {most}" in \
        capsys.readouterr().err
    with pytest.raises(HearthError, match=f"max_num_seqs {most + 1}: .* at most {most} sequences"):
        LLM(folder, kv_cache_memory=budget, max_num_seqs=most + 1, progress=False)
