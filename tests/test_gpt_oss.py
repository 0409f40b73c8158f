"""gpt-oss (transformers' gpt_oss) against transformers on a tiny random model in its real layout
(tests/models.py: sliding and full layers, attention sinks, experts with biases and the clamped
SwiGLU, YaRN): logits on the reference and cpu backends, greedy tokens in a batch mixing lengths
past the window with chunked prefill, and a GGUF laid out as llama.cpp's converter writes gpt-oss
(its tensor names, experts in MXFP4) against gguf's own dequantizer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth import LLM
from hearth.backend.base import Backend
from hearth.backend.cpu import CpuBackend, cpu_kernels
from hearth.errors import ModelLoadError
from hearth.config import ModelConfig
from hearth.loading.convert import add_tokenizer_metadata, convert_hf_to_gguf
from hearth.loading.gguf import load_gguf
from hearth.loading.safetensors import load_hf_folder
from hearth.model.transformer import Transformer
from models import VOCAB_SIZE, hearth_logits, load_hf_reference, make_hf_model
from test_engine import greedy, random_prompts, reference_greedy, token_ids

TOKENS = torch.randint(0, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(1)).tolist()  # 5 windows


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("gpt_oss") / "hf", "gpt_oss")


def _logits_of(folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_reference(folder)(torch.tensor([TOKENS])).logits[0]


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item()


def test_logits_match_transformers_on_both_backends(folder):
    config, weights = load_hf_folder(folder, progress=False)
    assert config.sliding_layers == (0,) and config.sliding_window == 8 and config.attention_sinks
    assert config.clamped_swiglu == (1.702, 1.5) and config.router_bias and config.mlp_bias
    want = _logits_of(folder)
    backends = [Backend()] + ([CpuBackend()] if cpu_kernels() is not None else [])
    for backend in backends:
        assert _max_error(hearth_logits(config, weights, TOKENS, backend=backend), want) <= 1e-4, backend.name


def test_greedy_batch_of_mixed_lengths_past_the_window(folder):
    """Prompts of 3 to 30 tokens, 16 new tokens each (every sequence passes the window of 8 while it
    decodes), 13-token steps (chunked prefill beside decodes): the cpu backend's decode kernel with sinks."""
    prompts = random_prompts(6, seed=7, shortest=3, longest=30)
    llm = LLM(folder, max_num_batched_tokens=13, progress=False)
    assert token_ids(llm.generate(prompts, greedy(16), use_tqdm=False)) == reference_greedy(folder, prompts, 16)


def test_refused_by_name(folder, tmp_path):
    """A backend without sinks (the gpu one's Triton kernels), writing gpt-oss GGUF, a SwiGLU limit that is no limit."""
    config, _ = load_hf_folder(folder, progress=False)
    no_sinks = type("NoSinks", (Backend,), {"name": "gpu", "attention_sinks": False})()
    with pytest.raises(ModelLoadError, match="gpu backend has no attention sinks"), torch.device("meta"):
        Transformer(config, backend=no_sinks)
    with pytest.raises(ModelLoadError, match="does not convert gpt_oss models to GGUF"):
        convert_hf_to_gguf(folder, tmp_path / "out.gguf", "f32", progress=False)
    hf = json.loads((folder / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="swiglu_limit"):
        ModelConfig.from_hf({**hf, "swiglu_limit": -1.0})


def _llama_cpp_writer(folder: Path, hf: dict, out: Path) -> gguf.GGUFWriter:
    """GptOssModel's metadata: the common keys, the window, the experts' width, yarn's."""
    writer = gguf.GGUFWriter(out, "gpt-oss")
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_expert_count(hf["num_local_experts"])
    writer.add_expert_used_count(hf["num_experts_per_tok"])
    writer.add_sliding_window(hf["sliding_window"])
    writer.add_expert_feed_forward_length(hf["intermediate_size"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(hf["rope_parameters"]["factor"])
    writer.add_rope_scaling_orig_ctx_len(hf["rope_parameters"]["original_max_position_embeddings"])
    add_tokenizer_metadata(writer, folder, hf["vocab_size"])
    return writer


def _write_as_llama_cpp(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    """A GGUF as llama.cpp's convert_hf_to_gguf.py writes gpt-oss (GptOssModel): names from gguf's tensor
    map (post_attention_norm, attn_sinks, ffn_gate_inp with its bias), the fused experts split into gate
    and up (the even and odd columns) and stacked [experts, rows, cols], experts' weights in MXFP4 and
    their biases stacked [experts, rows] in F32, yarn's keys. Returns transformers' state dict with the
    experts' weights as gguf dequantizes the file's blocks (the reference for the file)."""
    hf = json.loads((folder / "config.json").read_text())
    layers, experts = hf["num_hidden_layers"], hf["num_local_experts"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, layers)
    writer = _llama_cpp_writer(folder, hf, out)
    state = load_file(folder / "model.safetensors")
    reference = dict(state)
    for name, tensor in state.items():
        gguf_name = names.get_name(name.removesuffix("_bias").removesuffix(".weight").removesuffix(".bias"))
        if ".experts." not in name:
            suffix = ".bias" if name.endswith("bias") else ".weight"
            writer.add_tensor(gguf_name + suffix, tensor.numpy())
            continue
        bias = name.endswith("_bias")
        stacked = tensor if bias else tensor.transpose(-1, -2)  # [experts, out, in]
        parts = {"down_proj": stacked} if "down_proj" in name else \
            {"gate_proj": stacked[:, 0::2], "up_proj": stacked[:, 1::2]}
        dequantized = {}
        for part, rows in parts.items():
            part_name = names.get_name(name.replace("gate_up_proj", part).removesuffix("_bias"))
            if bias:
                writer.add_tensor(part_name + ".bias", rows.contiguous().numpy())
                continue
            flat = rows.reshape(-1, rows.shape[-1]).contiguous().numpy()
            blocks = gguf.quants.quantize(flat, gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(part_name + ".weight", blocks.reshape(experts, rows.shape[1], -1),
                              raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            dequantized[part] = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4))
        if not bias:  # back into transformers' fused layout
            if "down_proj" in name:
                reference[name] = dequantized["down_proj"].reshape(rows.shape).transpose(-1, -2).contiguous()
            else:
                fused = torch.empty_like(stacked)
                fused[:, 0::2], fused[:, 1::2] = (dequantized[p].reshape(fused[:, 0::2].shape) for p in parts)
                reference[name] = fused.transpose(-1, -2).contiguous()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def test_gguf_as_llama_cpp_writes_it_with_mxfp4_experts(tmp_path):
    """(llama.cpp fixes the SwiGLU's limit at gpt-oss's 7: no key says otherwise, so the model here has that one)"""
    folder = make_hf_model(tmp_path / "hf", "gpt_oss", swiglu_limit=7.0)
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    reference = _write_as_llama_cpp(folder, path)
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (dequantized / f.name).write_bytes(f.read_bytes())
    save_file(reference, dequantized / "model.safetensors")
    want = _logits_of(dequantized)
    config, weights, _ = load_gguf(path, progress=False)
    assert config.architecture == "gpt_oss" and config.sliding_layers == (0,) and config.rope_scaling["factor"] == 8.0
    assert weights["model.layers.0.mlp.experts.3.up_proj.weight"].qtype == gguf.GGMLQuantizationType.MXFP4
    # the reference backend: dequantize-then-matmul, exact up to fp32 rounding
    assert _max_error(hearth_logits(config, weights, TOKENS, backend=Backend()), want) <= 1e-4
    if cpu_kernels() is not None:  # the int8 kernels round activations to 8 bits per block, as llama.cpp (0.2% here)
        assert _max_error(hearth_logits(config, weights, TOKENS, backend=CpuBackend()), want) <= 1e-2 * want.abs().max()
