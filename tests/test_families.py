"""Today's model families against transformers on tiny random models: the mixtures of experts
(mixtral, qwen2_moe, qwen3_moe, olmoe) and gemma2 / gemma3 (soft-capping, sandwich norms, local
and global layers). From HF folders, from GGUF files hearth converts (float and quantized, against
gguf's own dequantizer) and, for the experts, from GGUF files named as llama.cpp's converter names
them (gguf's tensor map). Logits of every family against transformers: tests/test_model.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth import LLM
from hearth.backend.base import Backend
from hearth.backend.cpu import CpuBackend, cpu_kernels
from hearth.errors import ModelLoadError
from hearth.loading.convert import add_tokenizer_metadata, convert_hf_to_gguf
from hearth.loading.gguf import load_gguf
from hearth.loading.loader import load_model
from hearth.loading.names import canonical_hf_name
from hearth.model.layers import SparseMoE
from hearth.quant import QuantTensor, kernels
from models import MOE_ARCHITECTURES, VOCAB_SIZE, hearth_logits, load_hf_reference, make_hf_model
from test_engine import greedy, random_prompts, reference_greedy, token_ids
from test_model import _hearth_logits as paged_logits

TOKENS = torch.randint(0, VOCAB_SIZE, (45,), generator=torch.Generator().manual_seed(1)).tolist()
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 kv heads x head_dim 16 x fp32 (every family here)
FAMILIES = MOE_ARCHITECTURES + ("gemma2", "gemma3", "phi3")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: make_hf_model(root / arch, arch) for arch in FAMILIES}


@pytest.fixture(scope="module")
def reference_logits(folders) -> dict[str, torch.Tensor]:
    return {arch: _logits_of(folder) for arch, folder in folders.items()}


def _logits_of(folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_reference(folder)(torch.tensor([TOKENS])).logits[0]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_experts_replace_the_mlp(folders, reference_logits, arch):
    model = load_model(folders[arch], progress=False).model
    assert all(isinstance(layer.mlp, SparseMoE) and len(layer.mlp.experts) == 8 for layer in model.layers)
    assert _relative_error(paged_logits(model, TOKENS), reference_logits[arch]) <= 1e-4


def test_dense_layers_of_a_sparse_model(tmp_path):
    """qwen's mlp_only_layers / decoder_sparse_step give some layers a dense MLP."""
    folder = make_hf_model(tmp_path / "q", "qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1])
    model = load_model(folder, progress=False).model
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.layers] == [True, False, True]
    assert _relative_error(paged_logits(model, TOKENS), _logits_of(folder)) <= 1e-4
    path = convert_hf_to_gguf(folder, tmp_path / "q.gguf", "f32", progress=False)
    config, weights, _ = load_gguf(path, progress=False)
    assert config.dense_mlp_layers == (1,)
    assert _relative_error(hearth_logits(config, weights, TOKENS), _logits_of(folder)) <= 1e-4


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_batched_chunked_prefix_cached_preempted_matches_generate(folders, arch, tmp_path):
    """32 requests sharing a prefix, 17-token steps (chunked prefill), a cache too small for them all
    (preemption): greedy tokens equal transformers' generate; then the same from the GGUF hearth writes."""
    shared = random_prompts(1, seed=3, shortest=20, longest=20)[0]
    prompts = [shared + tail for tail in random_prompts(32, seed=FAMILIES.index(arch), longest=12)]
    expected = reference_greedy(folders[arch], prompts, max_tokens=16)
    gguf_path = convert_hf_to_gguf(folders[arch], tmp_path / "m.gguf", "f32", progress=False)
    for path in (folders[arch], gguf_path):
        llm = LLM(path, max_num_batched_tokens=17, kv_cache_memory=12 * 16 * KV_BYTES_PER_TOKEN, progress=False)
        outputs = llm.generate(prompts, greedy(16), use_tqdm=False)
        assert token_ids(outputs) == expected
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
        assert llm.engine.block_manager.prefix_cache_hits > 0
        alone = llm.generate([prompts[5]], greedy(16), use_tqdm=False)
        assert token_ids(alone) == expected[5:6]
        assert llm.engine.block_manager.check_all_free()


def _gguf_dequantized(weight) -> torch.Tensor:
    """gguf's own dequantizer (the reference for hearth's blocks)."""
    if isinstance(weight, QuantTensor):
        return torch.from_numpy(gguf.quants.dequantize(weight.data.numpy(), weight.qtype).copy()).reshape(weight.shape)
    return weight.float()


def _dequantized_reference(folder: Path, config, weights: dict, out: Path) -> Path:
    """A copy of the HF folder whose weights are the GGUF file's, dequantized by gguf (gemma's norms
    back from llama.cpp's 1 + w), and whose gemma query scale is the file's (convert folds a scale
    llama.cpp would not compute into the queries: the file's own is then llama.cpp's)."""
    out.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    hf = json.loads((out / "config.json").read_text())
    if "query_pre_attn_scalar" in hf:
        hf["query_pre_attn_scalar"] = config.query_pre_attn_scalar or config.head_dim
        (out / "config.json").write_text(json.dumps(hf))
    original = load_file(folder / "model.safetensors")
    shift = json.loads((folder / "config.json").read_text())["model_type"].startswith("gemma")
    save_file({k: (_gguf_dequantized(weights[canonical_hf_name(k)]) - float(shift and k.endswith("norm.weight"))).contiguous()
               for k in original}, out / "model.safetensors")
    return out


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("out_type", ["q8_0", "q4_0"])
def test_quantized_against_gguf_dequantizer(folders, arch, out_type, tmp_path):
    """Weights stay in their blocks (experts: one Int8Linear per expert over the file's stack). The
    reference backend equals transformers on gguf's dequantized weights; the cpu backend's int8
    kernels (activations rounded to int8 per block, as llama.cpp) stay within dense q8_0's error except, in a mixture of
    experts, at tokens whose top-k choice is nearly tied, where the rounding may pick another expert
    (as in llama.cpp). Mixtures of experts also on the CPU backend: the chosen experts of a layer in
    one grouped kernel call per projection (hearth/backend/cpu_experts.py)."""
    path = convert_hf_to_gguf(folders[arch], tmp_path / "m.gguf", out_type, progress=False)
    config, weights, _ = load_gguf(path, progress=False)
    matrix = weights["model.layers.0.mlp.experts.3.gate_proj.weight" if config.num_experts else
                     "model.layers.0.self_attn.o_proj.weight"]
    assert isinstance(matrix, QuantTensor) and matrix.qtype.name == out_type.upper()
    if config.num_experts:  # routers stay F32, as llama.cpp's
        assert not isinstance(weights["model.layers.0.mlp.gate.weight"], QuantTensor)
    want = _logits_of(_dequantized_reference(folders[arch], config, weights, tmp_path / "ref"))
    if kernels.extension() is not None and cpu_kernels() is not None:  # the cpu backend's int8 kernels
        kernel_logits = hearth_logits(config, weights, TOKENS, CpuBackend())
        per_token = (kernel_logits - want).abs().max(-1).values / want.abs().max()
        assert (per_token <= 5e-2).float().mean() >= 0.9, per_token
    # the reference backend: dequantize-then-matmul, exact up to fp32 rounding
    assert _relative_error(hearth_logits(config, weights, TOKENS, Backend()), want) <= 1e-4


# hearth's architecture -> llama.cpp's, and whether llama.cpp permutes Q/K rows
_LLAMA_CPP = {"mixtral": (gguf.MODEL_ARCH.LLAMA, True), "qwen2_moe": (gguf.MODEL_ARCH.QWEN2MOE, False),
              "qwen3_moe": (gguf.MODEL_ARCH.QWEN3MOE, False), "olmoe": (gguf.MODEL_ARCH.OLMOE, False)}


def _write_as_llama_cpp(folder: Path, arch: str, out: Path) -> Path:
    """A float32 GGUF written with gguf-py as llama.cpp's convert_hf_to_gguf lays MoE models out:
    names from gguf's tensor map, experts stacked [experts, rows, cols], its metadata keys (and no
    expert_weights_norm: llama.cpp fixes the normalisation per family)."""
    model_arch, permute = _LLAMA_CPP[arch]
    hf = json.loads((folder / "config.json").read_text())
    layers, heads, kv_heads = hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"]
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    names = gguf.get_tensor_name_map(model_arch, layers)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[model_arch])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(hf["num_experts_per_tok"])
    if "moe_intermediate_size" in hf:
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    if hf.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    add_tokenizer_metadata(writer, folder, hf["vocab_size"])

    tensors = load_file(folder / "model.safetensors")
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if "experts" in parts:  # model.layers.L.<mlp|block_sparse_moe>.experts.E.<proj>.weight
            e = parts.index("experts")
            stacks.setdefault(".".join(parts[:e + 1] + parts[e + 2:]), {})[int(parts[e + 1])] = tensor
            continue
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's LlamaModel.permute
            n = heads if "q_proj" in name else kv_heads
            tensor = tensor.reshape(n, 2, tensor.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    for name, by_expert in stacks.items():
        stacked = torch.stack([by_expert[e] for e in range(experts)]).float().numpy()
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_gguf_named_as_llama_cpp_names_it(folders, reference_logits, arch, tmp_path):
    path = _write_as_llama_cpp(folders[arch], arch, tmp_path / "llama-cpp.gguf")
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.ffn_gate_exps.weight" in names and "blk.0.ffn_gate_inp.weight" in names
    config, weights, _ = load_gguf(path, progress=False)
    assert config.num_experts == 8 and config.architecture == arch
    assert _relative_error(hearth_logits(config, weights, TOKENS), reference_logits[arch]) <= 1e-4
    # hearth's own converter writes the same names
    ours = {t.name for t in gguf.GGUFReader(convert_hf_to_gguf(folders[arch], tmp_path / "h.gguf", "f32",
                                                                progress=False)).tensors}
    assert ours == names


def test_inspect_shows_experts(folders):
    from hearth.model_info import model_info

    info = model_info(folders["qwen2_moe"])
    hf = json.loads((folders["qwen2_moe"] / "config.json").read_text())
    total = sum(t.numel() for t in load_file(folders["qwen2_moe"] / "model.safetensors").values())
    per_expert = 3 * hf["hidden_size"] * hf["moe_intermediate_size"]
    unused = hf["num_hidden_layers"] * (hf["num_experts"] - hf["num_experts_per_tok"]) * per_expert
    assert info["parameters"] == total
    assert info["experts"] == {"count": 8, "used_per_token": 3, "intermediate_size": 32, "shared_intermediate_size": 96,
                               "normalised": False, "active_parameters": total - unused}


def test_inspect_shows_windows_and_soft_caps(folders, capsys):
    from hearth.cli import main

    assert main(["inspect", str(folders["gemma2"])]) == 0
    out = capsys.readouterr().out
    assert "sliding window   128 tokens (layers 0)" in out and "soft-capping     attn 5, final 10" in out
    assert main(["inspect", str(folders["gemma3"]), "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["sliding_layers"], config["local_rope_theta"], config["rope_theta"]) == ([0], 10000.0, 1e6)
    assert main(["inspect", str(folders["phi3"])]) == 0  # a window on every layer: old blocks are freed
    assert "KV blocks        freed once older than every layer's window (24 tokens)" in capsys.readouterr().out


def test_nope_layers_llama_cpp_cannot_express_are_refused_by_convert(tmp_path):
    """smollm3 with its NoPE layer elsewhere than every 4th: runs from HF, but llama.cpp's smollm3
    has no key for that layout, so hearth convert refuses it (never writes a file that runs wrongly)."""
    folder = make_hf_model(tmp_path / "s", "smollm3", num_hidden_layers=2, no_rope_layers=[1, 0])
    model = load_model(folder, progress=False).model
    assert model.config.no_rope_layers == (1,)
    assert _relative_error(paged_logits(model, TOKENS), _logits_of(folder)) <= 1e-4
    with pytest.raises(ModelLoadError, match="NoPE layers"):
        convert_hf_to_gguf(folder, tmp_path / "s.gguf", "f32", progress=False)


def test_phi3_merged_projections_as_llama_cpp_names_them(folders, tmp_path):
    """phi3 stores q/k/v and gate/up merged; the GGUF keeps them merged (attn_qkv, and ffn_up holding
    gate and up, as llama.cpp's phi3 reads them), names within gguf's list for the architecture."""
    path = convert_hf_to_gguf(folders["phi3"], tmp_path / "p.gguf", "f32", progress=False)
    tensors = {t.name: t.shape.tolist() for t in gguf.GGUFReader(path).tensors}
    allowed = {gguf.TENSOR_NAMES[t].format(bid=b) + ".weight" for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.PHI3]
               for b in range(2)}
    assert set(tensors) <= allowed
    assert tensors["blk.0.attn_qkv.weight"] == [64, 64 + 2 * 32] and tensors["blk.0.ffn_up.weight"] == [64, 2 * 112]


@pytest.mark.parametrize("context", ["within the original", "past the original"])
def test_longrope_matches_transformers(context, tmp_path):
    """Phi-3's LongRoPE (a 64-token original context stretched to 256): hearth rotates every token
    with one factor list chosen by its context (llama.cpp's rule). An engine of 64 tokens runs the
    short factors, as transformers does on sequences within 64; one of 256 the long factors, as
    transformers does on prompts longer than 64. Both with the attention factor on cos and sin;
    from the HF folder and the GGUF hearth writes (the factors as llama.cpp's phi3 tensors)."""
    head_half = 8  # head_dim 16
    long = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(head_half)],
            "long_factor": [1.0 + 3.0 * i for i in range(head_half)],
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    folder = make_hf_model(tmp_path / "p", "phi3", rope_parameters=long, max_position_embeddings=256,
                           original_max_position_embeddings=64, sliding_window=None)
    within = context == "within the original"
    prompts = random_prompts(3, seed=11, shortest=10 if within else 70, longest=30 if within else 90)
    expected = reference_greedy(folder, prompts, max_tokens=20)
    gguf_file = convert_hf_to_gguf(folder, tmp_path / "p.gguf", "f32", progress=False)
    names = {t.name for t in gguf.GGUFReader(gguf_file).tensors}
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= names
    for path in (folder, gguf_file):
        llm = LLM(path, max_model_len=64 if within else 256, max_num_batched_tokens=32, progress=False)
        assert llm.engine.model.rope.attention_factor == pytest.approx((1 + math.log(4) / math.log(64)) ** 0.5)
        assert token_ids(llm.generate(prompts, greedy(20), use_tqdm=False)) == expected


def test_longrope_factors_of_the_wrong_length_are_refused(tmp_path):
    long = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    folder = make_hf_model(tmp_path / "p", "phi3", rope_parameters=long, max_position_embeddings=256,
                           original_max_position_embeddings=64)
    hf = json.loads((folder / "config.json").read_text())
    hf["rope_parameters"]["short_factor"] = [1.0] * 3
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ModelLoadError, match="short_factor: expected 8 positive numbers"):
        load_model(folder, progress=False)


def test_bad_expert_configs_and_files_are_refused(folders, tmp_path):
    hf = json.loads((folders["mixtral"] / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(folders["mixtral"], bad)
    (bad / "config.json").write_text(json.dumps({**hf, "num_experts_per_tok": 9}))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok = 9"):
        load_model(bad, progress=False)
    (bad / "config.json").write_text(json.dumps(hf))
    weights = load_file(bad / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(bad, progress=False)
    olmoe = json.loads((folders["olmoe"] / "config.json").read_text())
    shutil.copytree(folders["olmoe"], tmp_path / "clip")
    (tmp_path / "clip" / "config.json").write_text(json.dumps({**olmoe, "clip_qkv": 8.0}))
    with pytest.raises(ModelLoadError, match="clip_qkv"):
        load_model(tmp_path / "clip", progress=False)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_local_layers_past_their_window(arch, tmp_path):
    """A 16-token window on the local layers (the global ones see everything): prompts longer than
    it prefilled in chunks of 8, generations well past it: greedy tokens as transformers' windowed
    generate, from the HF folder and from the GGUF hearth writes."""
    folder = make_hf_model(tmp_path / arch, arch, sliding_window=16)
    prompts = random_prompts(4, seed=5, shortest=20, longest=40)
    expected = reference_greedy(folder, prompts, max_tokens=30)
    for path in (folder, convert_hf_to_gguf(folder, tmp_path / "m.gguf", "f32", progress=False)):
        llm = LLM(path, max_num_batched_tokens=8, kv_cache_memory=1 << 20, progress=False)
        assert token_ids(llm.generate(prompts, greedy(30), use_tqdm=False)) == expected
