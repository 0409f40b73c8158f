"""Gemma 4 (transformers' gemma4) against transformers on tiny random models in its real layout
(tests/models.py: sliding and full layers, the full ones wider with one KV head and v from k's projection,
two layers sharing an earlier layer's K/V with a double-wide MLP, per-layer embeddings, layer scalars,
proportional RoPE; and with experts beside the MLP, without per-layer embeddings): logits on the reference and
cpu backends, greedy tokens on the gpu backend, greedy tokens in a mixed batch with chunked prefill and forced
preemption, a prefix-cache hit against a cold run, the KV cache's per-layer shapes and bytes per token, the text
model of a Gemma4ForConditionalGeneration checkpoint, and what is refused by name."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth import LLM, SamplingParams
from hearth.backend.base import Backend
from hearth.backend.cpu import CpuBackend, cpu_kernels
from hearth.config import ModelConfig
from hearth.errors import ModelLoadError, RequestError
from hearth.loading.convert import convert_hf_to_gguf
from hearth.loading.safetensors import load_hf_folder
from hearth.model_info import model_info
from models import VOCAB_SIZE, hearth_logits, load_hf_reference, make_hf_model
from test_engine import greedy, random_prompts, reference_greedy, token_ids

TOKENS = torch.randint(0, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(1)).tolist()  # 5 windows
# the variant with experts, as the larger Gemma 4 models: no per-layer embeddings, no KV sharing (transformers
# cannot run sharing without per-layer embeddings); an output layer of its own
EXPERTS = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
               hidden_size_per_layer_input=0, num_kv_shared_layers=0, tie_word_embeddings=False)
# K/V bytes per token in float32, from tests/models.py's shapes: K and V of the sliding layers 0 and 2 (2 KV
# heads of 16) and of the full layer 1 (1 KV head of 32); layers 3 and 4 read layer 2's and layer 1's (with
# experts, no sharing: sliding layers 0, 2, 3 and full layers 1, 4 keep their own)
KV_BYTES = {"dense": 2 * (2 * 2 * 16 + 1 * 32) * 4, "experts": 2 * (3 * 2 * 16 + 2 * 32) * 4}


@pytest.fixture(scope="module", params=["dense", "experts"])
def family(request, tmp_path_factory):
    """(kind, folder, transformers' logits of TOKENS)."""
    folder = make_hf_model(tmp_path_factory.mktemp("gemma4") / "m", "gemma4",
                           **(EXPERTS if request.param == "experts" else {}))
    with torch.no_grad():
        logits = load_hf_reference(folder)(torch.tensor([TOKENS])).logits[0]
    return request.param, folder, logits


def test_logits_match_transformers_on_both_backends(family):
    kind, folder, want = family
    config, weights = load_hf_folder(folder, progress=False)
    assert config.sliding_layers == (0, 2, 3) and config.layer_head_dims == (16, 32, 16, 16, 32)
    assert config.layer_kv_heads == (2, 1, 2, 2, 1) and config.k_eq_v_layers == (1, 4) and config.value_norm
    sharing = kind == "dense"
    assert config.kv_sources == ((0, 1, 2, 2, 1) if sharing else ())
    assert config.double_wide_mlp_layers == ((3, 4) if sharing else ())
    assert config.rope_scaling["rope_type"] == "proportional"
    assert (config.num_experts, config.per_layer_input_size) == ((4, 0) if kind == "experts" else (0, 8))
    backends = [Backend()] + ([CpuBackend()] if cpu_kernels() is not None else [])
    for backend in backends:
        got = hearth_logits(config, weights, TOKENS, backend=backend)
        assert (got - want).abs().max().item() <= 1e-4, backend.name


def test_mixed_batch_chunked_prefill_and_preemption(family):
    """Prompts of 3 to 40 tokens (past the window of 8 and the shared layers' sources), 8 new tokens each,
    13-token steps (chunks beside decodes) and a cache of 6 blocks, fewer than the batch needs (preemption)."""
    kind, folder, _ = family
    prompts = random_prompts(5, seed=7, shortest=3, longest=40)
    llm = LLM(folder, max_num_batched_tokens=13, kv_cache_memory=6 * 16 * KV_BYTES[kind], progress=False)
    assert llm.engine.num_blocks == 6
    outputs = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert token_ids(outputs) == reference_greedy(folder, prompts, 8)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0


def test_prefix_cache_hit_equals_a_cold_run(family):
    """A second request sharing a 100-token prefix finds its 6 full blocks (every layer's K/V, the sharing
    layers' read from their sources' blocks) and gives the tokens and logprobs of an engine without the cache."""
    kind, folder, _ = family
    shared = random_prompts(1, seed=12, shortest=100, longest=100)[0]
    prompts = [shared + [3, 4, 5], shared + [7, 8]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    cached = LLM(folder, progress=False)
    outputs = [cached.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
    assert [o.num_cached_tokens for o in outputs] == [0, 96]
    cold = LLM(folder, enable_prefix_caching=False, progress=False).generate([prompts[1]], params, use_tqdm=False)[0]
    hit, fresh = outputs[1].outputs[0], cold.outputs[0]
    assert hit.token_ids == fresh.token_ids
    for ours, theirs in zip(hit.logprobs, fresh.logprobs):
        assert ours.keys() == theirs.keys()
        for token in ours:
            assert ours[token] == pytest.approx(theirs[token], abs=1e-5)


def test_kv_cache_per_layer_shapes_and_bytes(family, tmp_path):
    """The caches the runner allocates (one per layer that keeps K/V, of its shape; none for the sharing
    layers), the bytes per token hearth inspect and the engine's block count use, inspect's KV layers."""
    kind, folder, _ = family
    if kind == "experts":
        pytest.skip("the experts do not change the cache")
    info = model_info(folder, kv_budget_bytes=100 * KV_BYTES[kind], kv_element_size=4)
    assert info["kv_cache_bytes_per_token"] == KV_BYTES[kind] and info["kv_budget_tokens"] == 100
    assert info["kv_layers"] == {"shapes": [{"layers": [0, 2], "kv_heads": 2, "head_dim": 16},
                                            {"layers": [1], "kv_heads": 1, "head_dim": 32}], "shared": {3: 2, 4: 1}}
    llm = LLM(folder, kv_cache_memory=10 * 16 * KV_BYTES[kind], progress=False)
    caches = llm.engine.runner.kv_caches
    assert [tuple(tuple(t.shape) for t in layer) for layer in caches] == [
        ((160, 2, 16),) * 2, ((160, 1, 32),) * 2, ((160, 2, 16),) * 2, (), ()]
    with pytest.raises(RequestError, match="K/V differ in shape or are shared between layers \\(gemma4\\)"):
        llm.engine.export_kv(TOKENS)


def test_conditional_generation_checkpoint_runs_its_text_model(family, tmp_path, caplog):
    """Gemma4ForConditionalGeneration's layout (text_config, model.language_model.*, image and audio towers
    beside; a sharing layer's unused k_proj as some checkpoints carry it) without a vision_config: its text
    model, the towers not loaded (a warning names them), transformers' text model's logits (with a
    vision_config the image tower runs too: tests/test_vision_gemma4.py)."""
    kind, folder, want = family
    if kind == "experts":
        pytest.skip("the layout is the dense model's")
    out = tmp_path / "conditional"
    out.mkdir()
    for f in folder.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    tensors = {name.replace("model.", "model.language_model.", 1): t
               for name, t in load_file(folder / "model.safetensors").items()}
    tensors |= {"model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight": torch.zeros(4, 4),
                "model.audio_tower.output_proj.weight": torch.zeros(4, 4),
                "model.language_model.layers.3.self_attn.k_proj.weight": torch.zeros(32, 64)}
    save_file(tensors, out / "model.safetensors")
    text = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
        "audio_config": {"model_type": "gemma4_audio"}}))
    with caplog.at_level(logging.WARNING, logger="hearth"):
        config, weights = load_hf_folder(out, progress=False)
    assert "3 tensors not loaded" not in caplog.text and "2 tensors not loaded" in caplog.text
    assert config.architecture == "gemma4" and not config.accepts_images
    assert (hearth_logits(config, weights, TOKENS) - want).abs().max().item() <= 1e-4


def test_gpu_backend_matches_transformers(family):
    """The gpu backend's Triton kernels (under the interpreter without a GPU) on the layers' own K/V shapes (split
    counts per shape) and the sharing layers' sources' caches: prompts past the window in chunks, then decode
    steps of both sequences through the graph runner (capture off on a CPU)."""
    kind, folder, _ = family
    if kind == "experts":
        pytest.skip("the same attention (and no decode graphs: the experts group tokens on the host)")
    pytest.importorskip("triton")
    from test_gpu_backend import _greedy, _llm

    prompts = random_prompts(2, seed=5, shortest=17, longest=22)
    llm = _llm(folder)
    assert _greedy(llm, prompts, 3) == reference_greedy(folder, prompts, 3)
    assert "decode_graphs" in llm.engine.model.backend_state


def test_refused_by_name(family, tmp_path):
    """A GGUF of this layout (its last layers share K/V as llama.cpp's gemma4 cannot read them:
    tests/test_gemma4_gguf.py has the layouts it can), and config fields hearth does not implement."""
    kind, folder, _ = family
    if kind == "experts":
        pytest.skip("the same refusals")
    with pytest.raises(ModelLoadError, match=r"read the K/V of layers \[2, 1\] .* read layer 1 \(sliding ones\) and 2"):
        convert_hf_to_gguf(folder, tmp_path / "out.gguf", "f32", progress=False)
    hf = json.loads((folder / "config.json").read_text())
    for fields, message in (({"per_layer_config": {"1": {"intermediate_size": 8}}}, "intermediate_size is not "),
                            ({"num_kv_shared_layers": 4}, "layer 1 .full_attention. has no earlier layer"),
                            ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
                            ({"vocab_size_per_layer_input": 100}, "vocab_size_per_layer_input = 100"),
                            ({"hidden_size_per_layer_input": 10**9}, "per_layer_input_size = 1000000000")):
        with pytest.raises(ModelLoadError, match=message):
            ModelConfig.from_hf({**hf, **fields})
