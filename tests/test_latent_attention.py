"""deepseek_v2 (multi-head latent attention, its mixture of experts, YaRN) against transformers on a
tiny random model of DeepSeek-V2-Lite's shape (tests/models.py): logits, what the cache holds,
greedy generation with batching, chunked prefill, prefix caching and preemption, the gpu backend's Triton
kernels (against the absorbed formula, and greedy tokens through the engine), and the config
fields hearth refuses (its GGUF files: tests/test_deepseek2_gguf.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.backend import choose_backend
from hearth.engine.runner import BatchEntry, ModelRunner
from hearth.errors import ModelLoadError, RequestError
from hearth.loading.loader import load_model
from hearth.model.latent_attention import LatentAttention
from hearth.model.layers import SparseMoE
from hearth.model_info import model_info
from models import VOCAB_SIZE, load_hf_reference, make_hf_model
from test_engine import greedy, random_prompts, reference_greedy, token_ids
from test_gpu_backend import DEVICE, _greedy, _llm
from test_model import _hearth_logits as paged_logits

TOKENS = torch.randint(0, VOCAB_SIZE, (45,), generator=torch.Generator().manual_seed(1)).tolist()
RANK, ROPE, LAYERS = 32, 8, 3  # tests/models.py's kv_lora_rank, qk_rope_head_dim, layers
KV_BYTES_PER_TOKEN = LAYERS * (RANK + ROPE) * 4  # one latent per layer, fp32


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("deepseek") / "m", "deepseek_v2")


@pytest.fixture(scope="module")
def reference(folder):
    return load_hf_reference(folder)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("chunks", [(45,), (20, 1, 1, 16, 1, 1, 5)], ids=["prompt", "chunks-and-decodes"])
def test_logits_match_transformers(folder, reference, backend, chunks):
    """A prompt in one pass, and in chunks with single-token (decode) steps between them."""
    model = load_model(folder, progress=False, backend=choose_backend(torch.device("cpu"), torch.float32,
                                                                      backend)).model
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.layers] == [False, True, True]
    assert all(isinstance(layer.self_attn, LatentAttention) for layer in model.layers)
    with torch.no_grad():
        want = reference(torch.tensor([TOKENS])).logits[0]
    assert _relative_error(paged_logits(model, TOKENS, chunks), want) <= 1e-5


def test_deepseek_v2_query_rank_expert_groups_and_biases(tmp_path):
    """DeepSeek-V2's features that Lite lacks: the query through q_a_proj, q_a_layernorm and q_b_proj,
    experts chosen within the best groups (group_limited_greedy; without the groups the logits differ),
    and attention biases."""
    folder = make_hf_model(tmp_path / "v2", "deepseek_v2", q_lora_rank=24, topk_method="group_limited_greedy",
                           n_group=2, topk_group=1, attention_bias=True)
    model = load_model(folder, progress=False).model
    assert (model.config.q_lora_rank, model.config.expert_groups, model.config.topk_groups) == (24, 2, 1)
    with torch.no_grad():
        want = load_hf_reference(folder)(torch.tensor([TOKENS])).logits[0]
    chunks = (20, 1, 1, 16, 1, 1, 5)
    assert _relative_error(paged_logits(model, TOKENS, chunks), want) <= 1e-5
    for layer in model.layers[1:]:
        layer.mlp.expert_groups = 0
    assert _relative_error(paged_logits(model, TOKENS, chunks), want) > 1e-3


def test_cache_holds_the_normed_latent_and_rotated_key(folder, reference):
    """Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim values: transformers' own
    cache entries (the latent after kv_a_layernorm, k_pe after RoPE; hearth keeps k_pe's even
    dimensions before its odd ones)."""
    model = load_model(folder, progress=False).model
    assert model.config.kv_cache_layout(0) == (1, 1, RANK + ROPE)
    assert model.config.kv_bytes_per_token(4) == KV_BYTES_PER_TOKEN
    runner = ModelRunner(model, num_blocks=4, block_size=16, device=torch.device("cpu"), kv_dtype=torch.float32)
    assert [tuple(t.shape) for cache in runner.kv_caches for t in cache] == [(64, 1, RANK + ROPE)] * LAYERS
    table = [3, 1, 0, 2]
    runner.forward([BatchEntry(TOKENS, 0, table)])
    slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(len(TOKENS))])
    with torch.no_grad():
        cache = reference(torch.tensor([TOKENS]), use_cache=True).past_key_values
    for layer, (ours,) in enumerate(runner.kv_caches):
        latent, k_pe = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]  # [T, rank], [T, rope]
        pairs_split = torch.cat([k_pe[:, 0::2], k_pe[:, 1::2]], dim=-1)
        torch.testing.assert_close(ours[slots, 0], torch.cat([latent, pairs_split], dim=-1), rtol=1e-5, atol=1e-5)


def test_greedy_batched_chunked_prefix_cached_preempted_matches_generate(folder):
    """32 requests sharing a prefix, 17-token steps, a cache of 12 blocks (preemption); then one alone.
    The block count comes from the budget at the compressed size."""
    shared = random_prompts(1, seed=3, shortest=20, longest=20)[0]
    prompts = [shared + tail for tail in random_prompts(32, seed=7, longest=12)]
    expected = reference_greedy(folder, prompts, max_tokens=16)
    llm = LLM(folder, max_num_batched_tokens=17, kv_cache_memory=12 * 16 * KV_BYTES_PER_TOKEN, progress=False)
    assert llm.engine.num_blocks == 12
    outputs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert token_ids(outputs) == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.engine.block_manager.prefix_cache_hits > 0
    assert token_ids(llm.generate([prompts[5]], greedy(16), use_tqdm=False)) == expected[5:6]
    assert llm.engine.block_manager.check_all_free()


def test_inspect_shows_the_latent(folder):
    info = model_info(folder, kv_element_size=4)
    assert info["kv_cache_bytes_per_token"] == KV_BYTES_PER_TOKEN
    assert info["latent_attention"] == {"kv_lora_rank": RANK, "qk_rope_head_dim": ROPE, "qk_nope_head_dim": 16,
                                        "v_head_dim": 12, "values_per_token_per_layer": RANK + ROPE,
                                        "per_head_kv_values_per_token_per_layer": 4 * (16 + ROPE + 12)}
    assert info["experts"]["count"] == 8 and info["experts"]["shared_intermediate_size"] == 64


@pytest.mark.parametrize("fields,message", [
    ({"topk_method": "noaux_tc"}, "topk_method"), ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"norm_topk_prob": True}, "norm_topk_prob"), ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group = 3"),  # 8 experts
    ({"num_key_value_heads": 2}, "num_key_value_heads"), ({"kv_lora_rank": 0}, "kv_lora_rank = 0"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_scaling type 'dynamic'"),
])
def test_unimplemented_fields_are_refused_by_name(folder, tmp_path, fields, message):
    config = {**json.loads((folder / "config.json").read_text()), **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for file in folder.iterdir():
        if file.name != "config.json":
            (tmp_path / file.name).symlink_to(file)
    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path, progress=False)


def test_gpu_backend_matches_transformers(tmp_path):
    """The gpu backend's Triton kernels (under the interpreter without a GPU): the RoPE kernel writing the latent
    and k_pe into one cache row, prompts in chunks over the latent (the absorbed prefill kernel), then decode
    steps of three sequences through the graph runner (a bucket of four, its padding row harmless; capture off
    on a CPU) with split-KV and the merge: transformers' greedy tokens. Every layer dense (first_k_dense_replace):
    a mixture of experts keeps a step out of the decode graphs."""
    pytest.importorskip("triton")

    folder = make_hf_model(tmp_path / "dense", "deepseek_v2", num_hidden_layers=2, first_k_dense_replace=2)
    prompts = random_prompts(3, seed=4, shortest=10, longest=20)
    llm = _llm(folder)
    assert _greedy(llm, prompts, 4) == reference_greedy(folder, prompts, 4)
    assert "decode_graphs" in llm.engine.model.backend_state
    # the latent kernels take no tree masks: token trees and contrastive search refused by name
    with pytest.raises(RequestError, match="contrastive search .* deepseek_v2 on the gpu backend"):
        llm.generate([prompts[0]], SamplingParams(penalty_alpha=0.5, top_k=3, max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="token-tree verification.* deepseek_v2 on the gpu backend"):
        _llm(folder, speculative_method="ngram", speculative_tree_width=3)


def _absorbed_attention(q, cache, table, context, rank, scale, block_size=16):
    """q [n, heads, rank + rope]: a sequence's last n positions over its context's cached rows [rank + rope]
    (a block table's), causal, in float64: softmax(q . row x scale) times each row's first rank values."""
    positions = torch.arange(context)
    rows = cache[table.long()[positions // block_size] * block_size + positions % block_size, 0].double()
    scores = torch.einsum("qhw,kw->qhk", q.double(), rows) * scale
    sees = positions[None, None, :] <= torch.arange(context - len(q), context)[:, None, None]
    return torch.einsum("qhk,kr->qhr", scores.masked_fill(~sees, float("-inf")).softmax(-1), rows[:, :rank])


def test_triton_latent_kernels_match_the_absorbed_formula():
    """hearth/triton_kernels/latent_attention.py against the formula: prefill of a chunk after a cached prefix,
    a whole prompt and a decode row in one launch; decode in one split and in three that each hold work, and a
    padding row (context 0: zeros)."""
    pytest.importorskip("triton")
    from hearth.triton_kernels import latent_attention as kernels

    gen = torch.Generator().manual_seed(0)
    width, scale, contexts = RANK + ROPE, 0.3, [150, 9, 40]
    tables = torch.randperm(33, generator=gen).to(torch.int32).view(3, 11)  # shuffled blocks of 16 slots
    cache = torch.randn(33 * 16, 1, width, generator=gen)
    q = torch.randn(13, 4, width, generator=gen)
    starts = [0, 3, 12, 13]  # query rows 3, 9, 1
    on = {name: t.to(DEVICE) for name, t in [("q", q), ("cache", cache), ("tables", tables)]}
    got = kernels.prefill_attention(on["q"], on["cache"], RANK, on["tables"],
                                    torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                                    torch.tensor(contexts, dtype=torch.int32, device=DEVICE), scale, 16, 9).cpu()
    want = torch.cat([_absorbed_attention(q[starts[s] : starts[s + 1]], cache, tables[s], contexts[s], RANK, scale)
                      for s in range(3)])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    last_rows = [2, 11, 12]
    for splits in (1, 3):
        lens = torch.tensor([150, 9, 0], dtype=torch.int32, device=DEVICE)
        got = kernels.decode_attention(on["q"][last_rows], on["cache"], RANK, on["tables"], lens, scale, 16, splits).cpu()
        torch.testing.assert_close(got[:2].double(), want[last_rows[:2]], rtol=1e-5, atol=1e-5)
        assert (got[2] == 0).all()


def test_bench_shape_of_deepseek_v2_lite(tmp_path):
    """`hearth bench make-model`'s deepseek-v2-lite-4l: DeepSeek-V2-Lite's 15.7B parameters when extended
    to its 27 layers; shrunk, its HF folder runs in hearth as in transformers, and its Q8_0 GGUF loads."""
    from hearth.bench import models as bench_models

    spec = bench_models.ARCHS["deepseek-v2-lite-4l"]
    per_layer = spec.num_parameters() - dataclasses.replace(spec, num_layers=spec.num_layers - 1).num_parameters()
    assert round((spec.num_parameters() + (27 - spec.num_layers) * per_layer) / 1e8) == 157
    small = dataclasses.replace(spec, vocab_size=1024, hidden_size=64, intermediate_size=64, num_layers=2,
                                num_heads=4, num_kv_heads=4, bos_token_id=1000, eos_token_id=1001,
                                extra={**spec.extra, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                                       "head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 32})
    files = bench_models.make_model(small, tmp_path, ["q8_0"], progress=False)["files"]
    folder = Path(files["hf"])
    assert LLM(files["q8_0"], kv_cache_memory=1 << 20, progress=False).engine.model.config.kv_lora_rank == 32
    llm = LLM(folder, kv_cache_memory=1 << 20, progress=False)
    assert llm.engine.model.config.kv_cache_layout(0) == (1, 1, 40)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    assert token_ids(llm.generate(prompts, greedy(6), use_tqdm=False)) == reference_greedy(folder, prompts, 6)


def test_a_q8_0_cache_is_refused_for_the_latent(folder):
    """The latent cache's keys and values are views of one tensor: no q8_0 blocks for it (yet)."""
    with pytest.raises(ValueError, match="not implemented for multi-head latent attention"):
        LLM(folder, kv_cache_dtype="q8_0", progress=False)
