"""hearth's decoder against transformers on tiny random models of every architecture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hearth.engine.runner import BatchEntry, ModelRunner
from hearth.errors import ModelLoadError
from hearth.loading.loader import load_model
from models import ARCHITECTURES, VOCAB_SIZE, load_hf_reference, make_hf_model

TOKENS = torch.randint(0, VOCAB_SIZE, (45,), generator=torch.Generator().manual_seed(1)).tolist()


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _reference_logits(folder, tokens, dtype=torch.float32):
    ref = load_hf_reference(folder).to(dtype)
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def _hearth_logits(model, tokens, chunks=(len(TOKENS),), block_size=16):
    """Run the tokens through the paged runner in chunks, on a scrambled block table."""
    num_blocks = -(-len(tokens) // block_size) + 2
    runner = ModelRunner(model, num_blocks, block_size, torch.device("cpu"), model.dtype)
    table = list(reversed(range(num_blocks)))
    hidden, start = [], 0
    for size in chunks:
        h, _ = runner.forward([BatchEntry(tokens[start : start + size], start, table)])
        hidden.append(h)
        start += size
    return model.compute_logits(torch.cat(hidden))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers_fp32(tmp_path, arch):
    folder = make_hf_model(tmp_path / arch, arch)
    model = load_model(folder, progress=False).model
    ours = _hearth_logits(model, TOKENS)
    assert _relative_error(ours, _reference_logits(folder, TOKENS)) <= 1e-4


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"num_key_value_heads": 1}),  # MQA
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
        ("qwen2", {"num_key_value_heads": 4}),  # plain multi-head
        # YaRN (deepseek_v2's; any family's in transformers): ramped frequencies and a cos/sin factor
        ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                       "original_max_position_embeddings": 16}}),
    ],
)
def test_variants_match_transformers(tmp_path, arch, overrides):
    folder = make_hf_model(tmp_path / arch, arch, **overrides)
    model = load_model(folder, progress=False).model
    assert _relative_error(_hearth_logits(model, TOKENS), _reference_logits(folder, TOKENS)) <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_paged_chunks_and_decode_steps_match(tmp_path, arch):
    """Prefill in uneven chunks then token-by-token decode gives the full-prompt logits."""
    folder = make_hf_model(tmp_path / arch, arch)
    model = load_model(folder, progress=False).model
    chunks = (7, 16, 3) + (1,) * (len(TOKENS) - 26)
    ours = _hearth_logits(model, TOKENS, chunks=chunks, block_size=4)
    assert _relative_error(ours, _reference_logits(folder, TOKENS)) <= 1e-4


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 0.05), (torch.float16, 0.01)])
def test_low_precision_compute_close_to_fp32(tmp_path, dtype, tolerance):
    """bf16/f16 compute stays within the rounding a 16-bit model shows in transformers too."""
    folder = make_hf_model(tmp_path / "llama", "llama")
    model = load_model(folder, dtype=dtype, progress=False).model
    ours = _hearth_logits(model, TOKENS)
    assert ours.dtype == torch.float32
    assert _relative_error(ours, _reference_logits(folder, TOKENS)) <= tolerance


def _bf16_folder(tmp_path):
    """A tiny random llama saved in bf16, as Hugging Face folders of bf16 models are."""
    import json

    from safetensors.torch import load_file, save_file

    folder = make_hf_model(tmp_path / "llama", "llama")
    weights = load_file(folder / "model.safetensors")
    save_file({name: w.bfloat16() for name, w in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    return folder


def test_bf16_folder_matches_transformers_bf16(tmp_path):
    """A bf16 folder: computing in bf16 (the reference backend) hearth multiplies the file's bf16
    weights as they are and lands as close to the exact (float32) product of those weights
    as transformers' own bf16 run does: at most twice its logit error, a tolerance on logits rather
    than on tokens because two bf16 computations that round in different places may split a near
    tie differently. In float32 (the default on a CPU) the cpu backend keeps the weights in bf16
    (HalfLinear on half_matmul) and multiplies them exactly: within 1e-4; where the kernels take bf16
    pairs, by the activations rounded to bf16: then closer than transformers' bf16 run (which rounds
    those and every result). (Not within 1e-4 of transformers' float32 model with its Linear inputs
    rounded: fp32 values 1e-7 apart round to bf16 values one unit apart, about once per 10^4.)"""
    from hearth.backend.cpu_linear import HalfLinear
    from hearth.loading.safetensors import load_hf_folder
    from hearth.quant import kernels

    folder = _bf16_folder(tmp_path)
    model = load_model(folder, dtype=torch.bfloat16, progress=False).model
    _, stored = load_hf_folder(folder, progress=False)
    o_proj = model.layers[0].self_attn.o_proj.weight
    assert torch.equal(o_proj, stored["model.layers.0.self_attn.o_proj.weight"]) and o_proj.dtype == torch.bfloat16
    exact = _reference_logits(folder, TOKENS)  # the bf16 weights in a float32 model
    transformers_bf16 = _reference_logits(folder, TOKENS, torch.bfloat16)
    bf16_error = _relative_error(transformers_bf16, exact)
    assert _relative_error(_hearth_logits(model, TOKENS), exact) <= 2 * bf16_error
    model32 = load_model(folder, progress=False).model
    assert any(isinstance(m, HalfLinear) and m.qtype.name == "BF16" for m in model32.modules())
    pairs_from = kernels.extension().module.half_bf16_min_rows() if kernels.extension() is not None else 0
    bound = bf16_error if 0 < pairs_from <= len(TOKENS) else 1e-4
    assert _relative_error(_hearth_logits(model32, TOKENS), exact) <= bound


def test_bf16_folder_greedy_equals_transformers_bf16_generate(tmp_path):
    """Greedy decoding of the bf16 folder in bf16, through the engine (prefill, then decode steps
    on the paged cache): the tokens of transformers' bf16 `generate`. (These prompts' top-1 margins
    exceed both runs' bf16 rounding; the logit test above bounds that rounding in general.)"""
    from hearth import LLM, SamplingParams

    folder = _bf16_folder(tmp_path)
    llm = LLM(folder, dtype="bfloat16", progress=False)
    reference = load_hf_reference(folder).to(torch.bfloat16)
    prompts = [TOKENS[:5], TOKENS[8:30], TOKENS[30:33]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with torch.no_grad():
        theirs = [reference.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(p):]
                  .tolist() for p in prompts]
    assert [list(t) for t in ours] == theirs


def test_missing_tensor_and_wrong_shape_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_hf_model(tmp_path / "llama", "llama")
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    damaged = dict(weights)
    del damaged[name]
    save_file(damaged, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_model(folder, progress=False)
    damaged[name] = weights[name][:, :10].contiguous()
    save_file(damaged, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(folder, progress=False)


def test_sharded_safetensors_folder(tmp_path):
    folder = make_hf_model(tmp_path / "one", "qwen3")
    sharded = tmp_path / "sharded"
    load_hf_reference(folder).save_pretrained(sharded, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((folder / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 2
    model = load_model(sharded, progress=False).model
    assert _relative_error(_hearth_logits(model, TOKENS), _reference_logits(folder, TOKENS)) <= 1e-4
    next(sharded.glob("model-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="shard files missing"):
        load_model(sharded, progress=False)


def test_biases_on_every_projection_match_transformers(tmp_path):
    """llama's attention_bias puts a bias on o_proj too, and mlp_bias on gate/up/down."""
    folder = make_hf_model(tmp_path / "llama", "llama", attention_bias=True, mlp_bias=True)
    model = load_model(folder, progress=False).model
    assert _relative_error(_hearth_logits(model, TOKENS), _reference_logits(folder, TOKENS)) <= 1e-4


@pytest.mark.parametrize("out_type", [None, "f32"])
@pytest.mark.parametrize("arch,overrides", [("mistral", {}), ("qwen2", {"use_sliding_window": True, "max_window_layers": 1})])
def test_sliding_window_generations_longer_than_the_window_match(tmp_path, out_type, arch, overrides):
    """A 24-token window (mistral: every layer; qwen2: the layers from max_window_layers on):
    prompts longer than it, prefilled in chunks of 8 (each chunk's window reaching into the previous
    ones), then decoded well past it, batched: greedy tokens as transformers' windowed generate
    (from the HF folder and from the GGUF hearth writes)."""
    from hearth import LLM, SamplingParams
    from hearth.loading.convert import convert_hf_to_gguf

    folder = make_hf_model(tmp_path / arch, arch, sliding_window=24, **overrides)
    path = folder if out_type is None else convert_hf_to_gguf(folder, tmp_path / "m.gguf", out_type, progress=False)
    llm = LLM(path, kv_cache_memory=1 << 20, max_num_batched_tokens=8, progress=False)
    assert llm.engine.max_model_len == 512
    assert llm.engine.model_config.sliding_layers == (None if arch == "mistral" else (1,))
    prompts = [TOKENS[:30], TOKENS[5:15], TOKENS[:41]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    reference = load_hf_reference(folder)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_sliding_window_blocks_are_freed_behind_the_window(tmp_path, backend):
    """mistral with a 24-token window on every layer, blocks of 4: prompts longer than the window in
    chunks of 8, generations well past it, then the same prompts again (prefix-cache hits on blocks
    freed behind the window) and under a cache too small for all at once (preemption and recompute):
    greedy tokens as transformers' windowed generate, while no request ever holds more blocks than
    its window and a chunk span, and every block is free at the end."""
    from hearth import LLM, SamplingParams
    from hearth.engine.kv_cache import NO_BLOCK

    window, block, budget, max_tokens = 24, 4, 8, 40
    folder = make_hf_model(tmp_path / "mistral", "mistral", sliding_window=window)
    prompts = [TOKENS[:30], TOKENS[5:15], TOKENS[:41], TOKENS[2:32]]
    reference = load_hf_reference(folder)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        expected.append(reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist())
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    most_held = -(-(window - 1 + budget) // block) + 1  # the window's positions and a chunk's, block-aligned
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * block  # K and V x 2 layers x 2 kv heads x head_dim 16 x fp32
    for blocks in (200, 21):  # 21 blocks (84 tokens): room for each request alone, not for all four
        llm = LLM(folder, backend=backend, block_size=block, max_num_batched_tokens=budget,
                  kv_cache_memory=blocks * bytes_per_block, progress=False)
        engine = llm.engine
        assert engine.model_config.kv_window == window and engine.num_blocks == blocks
        for _ in range(2):  # the second time through, the prompts' blocks come from the prefix cache
            for prompt in prompts:
                engine.add_request(None, prompt, params)
            outputs, held, preemptions = {}, 0, 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs[int(out.request_id)] = out.outputs[0].token_ids
                        preemptions += out.metrics.num_preemptions
                running = engine.scheduler.running
                held = max([held] + [sum(b != NO_BLOCK for b in r.block_table) for r in running])
            assert [outputs[i] for i in sorted(outputs)] == expected
            assert 0 < held <= most_held < -(-(41 + max_tokens) // block) // 2  # bounded, and it matters
            assert engine.block_manager.check_all_free()
            assert preemptions > 0 if blocks == 21 else preemptions == 0
        if blocks == 200:
            assert engine.block_manager.prefix_cache_hits >= sum(len(p) // block - 1 for p in prompts) * block


def test_unimplemented_features_are_refused(tmp_path):
    """A config field or a tensor hearth has no place for is an error naming it, never dropped."""
    import json

    from safetensors.torch import load_file, save_file

    folder = make_hf_model(tmp_path / "llama", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.5}))
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        load_model(folder, progress=False)
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(8, 64)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight"):
        load_model(folder, progress=False)


@pytest.mark.parametrize("extra, message", [
    # read by hearth (tests/test_library_quant.py), but these folders hold none of their packed tensors
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}}, "'awq'.*qweight"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}},
     "'gptq'.*qweight"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "'fp8'.*weight_scale_inv"),
    ({"quantization_config": {"load_in_4bit": True}}, "'unnamed'.*GGUF"),
    ({"vision_config": {"hidden_size": 32}}, "image encoder"),
], ids=["awq", "gptq", "fp8", "bitsandbytes", "vision"])
def test_quantized_and_multimodal_checkpoints_are_refused_by_name(tmp_path, extra, message):
    """Checked before any tensor is looked for (their tensors have other names and would be reported
    missing, naming neither the format nor the fix): by load and by convert."""
    import json

    from hearth.loading.convert import convert_hf_to_gguf

    folder = make_hf_model(tmp_path / "llama", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **extra}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(folder, progress=False)
    with pytest.raises(ModelLoadError, match=message):
        convert_hf_to_gguf(folder, tmp_path / "out.gguf", "f16", progress=False)
    assert not (tmp_path / "out.gguf").exists()


def test_gguf_tensor_hearth_does_not_know_is_refused(tmp_path):
    import gguf

    from hearth.loading.convert import convert_hf_to_gguf

    folder = make_hf_model(tmp_path / "llama", "llama")
    source = gguf.GGUFReader(convert_hf_to_gguf(folder, tmp_path / "m.gguf", "f32", progress=False))
    writer = gguf.GGUFWriter(tmp_path / "extra.gguf", "llama")
    for field in source.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, field.contents())
        else:
            writer.add_key_value(field.name, field.contents(), kind)
    for tensor in source.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_gate_exps\.weight"):
        load_model(tmp_path / "extra.gguf", progress=False)
