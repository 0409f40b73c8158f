"""gpt-oss (transformers' gpt_oss) against transformers on a tiny random model in its real layout
(tests/models.py: sliding and full layers, attention sinks, experts with biases and the clamped
SwiGLU, YaRN): logits on the reference and cpu backends, greedy tokens in a batch mixing lengths
past the window with chunked prefill; a GGUF laid out as llama.cpp's converter writes gpt-oss (its
tensor names, experts in MXFP4) against gguf's own dequantizer, and hearth convert's; an HF folder
with MXFP4 experts as OpenAI releases them against transformers' own dequantization. Then harmony's
tool calls: the parser on the text gpt-oss writes, and the served model through chat completions,
Responses and Messages with gpt-oss's chat template."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
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
from hearth.tokenizer import Tokenizer
from models import VOCAB_SIZE, hearth_logits, load_hf_reference, make_hf_model
from test_engine import greedy, random_prompts, reference_greedy, token_ids

TOKENS = torch.randint(0, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(1)).tolist()  # 5 windows
HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


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


def test_gpu_backend_logits_and_greedy_tokens_match_transformers(folder):
    """The gpu backend's Triton kernels (interpreted on the CPU without a GPU): the prefill kernel with sinks over
    5 windows of the sliding layer, logits within 1e-4; then greedy tokens past the window, chunks of 13 tokens
    beside decodes (the split decode kernel with sinks, through the decode graphs' eager path)."""
    from hearth.backend.gpu import GpuBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config, weights = load_hf_folder(folder, progress=False)
    got = hearth_logits(config, weights, TOKENS, backend=GpuBackend(device, use_cuda_graphs=False), device=device)
    assert _max_error(got.cpu(), _logits_of(folder)) <= 1e-4
    prompts = random_prompts(2, seed=8, shortest=3, longest=14)
    llm = LLM(folder, device=device, dtype="float32", backend="gpu", max_num_batched_tokens=13, progress=False)
    assert token_ids(llm.generate(prompts, greedy(4), use_tqdm=False)) == reference_greedy(folder, prompts, 4)


def test_refused_by_name(folder, tmp_path):
    """Writing a GGUF llama.cpp would misread, a SwiGLU limit that is no limit."""
    with pytest.raises(ModelLoadError, match="llama.cpp's gpt-oss fixes"):  # (a limit of 1.5 here)
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
    start, end, *_, finish, call = _add_harmony_tokens(folder)
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    reference = _write_as_llama_cpp(folder, path)
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (dequantized / f.name).write_bytes(f.read_bytes())
    save_file(reference, dequantized / "model.safetensors")
    want = _logits_of(dequantized)
    config, weights, metadata = load_gguf(path, progress=False)
    assert config.architecture == "gpt_oss" and config.sliding_layers == (0,) and config.rope_scaling["factor"] == 8.0
    # harmony's vocabulary: a reply ends at <|return|> or <|call|>, not at the <|end|> of its analysis message
    stops = Tokenizer.from_gguf_metadata(metadata).eos_token_ids
    assert finish in stops and call in stops and end not in stops and start not in stops
    assert weights["model.layers.0.mlp.experts.3.up_proj.weight"].qtype == gguf.GGMLQuantizationType.MXFP4
    # the reference backend: dequantize-then-matmul, exact up to fp32 rounding
    assert _max_error(hearth_logits(config, weights, TOKENS, backend=Backend()), want) <= 1e-4
    if cpu_kernels() is not None:  # the int8 kernels round activations to 8 bits per block, as llama.cpp (0.2% here)
        assert _max_error(hearth_logits(config, weights, TOKENS, backend=CpuBackend()), want) <= 1e-2 * want.abs().max()
    # hearth convert writes the same names (its experts in the type asked for), read back as the folder
    ours = convert_hf_to_gguf(folder, tmp_path / "hearth.gguf", "f32", progress=False)
    assert {t.name for t in gguf.GGUFReader(ours).tensors} == {t.name for t in gguf.GGUFReader(path).tensors}
    config, weights, _ = load_gguf(ours, progress=False)
    assert _max_error(hearth_logits(config, weights, TOKENS), _logits_of(folder)) <= 1e-4


def _copy_folder(folder: Path, out: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    """`folder` with other tensors and config fields."""
    out.mkdir()
    for f in folder.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **config}))
    save_file(tensors, out / "model.safetensors")
    return out


def test_hf_folder_with_mxfp4_experts_as_openai_releases_them(folder, tmp_path):
    """OpenAI's checkpoints: the experts' weights as `_blocks` (two 4-bit codes a byte) and `_scales` (a
    power of two a block of 32) under quantization_config mxfp4, the rest unquantized. Read into GGUF's
    MXFP4 blocks (kept in 4 bits): the logits of transformers on the weights its own mxfp4 integration
    dequantizes (convert_moe_packed_tensors) from the same bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state, packed, dense = load_file(folder / "model.safetensors"), {}, {}
    generator = torch.Generator().manual_seed(5)
    for name, tensor in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = dense[name] = tensor
            continue
        experts, columns, rows = tensor.shape  # the fused layout: [experts, in, out]
        blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(120, 125, (experts, rows, columns // 32), dtype=torch.uint8, generator=generator)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                        "model.layers.*.mlp.router", "lm_head"]}
    mxfp4 = _copy_folder(folder, tmp_path / "mxfp4", packed, quantization_config=quantization)
    want = _logits_of(_copy_folder(folder, tmp_path / "dense", dense))
    config, weights = load_hf_folder(mxfp4, progress=False)
    assert weights["model.layers.1.mlp.experts.2.gate_proj.weight"].qtype == gguf.GGMLQuantizationType.MXFP4
    assert _max_error(hearth_logits(config, weights, TOKENS, backend=Backend()), want) <= 1e-4 * want.abs().max()
    if cpu_kernels() is not None:  # the int8 kernels round activations to 8 bits per block, as llama.cpp
        assert _max_error(hearth_logits(config, weights, TOKENS, backend=CpuBackend()), want) <= 1e-2 * want.abs().max()
    with pytest.raises(ModelLoadError, match="does not write MXFP4"):
        convert_hf_to_gguf(mxfp4, tmp_path / "out.gguf", "f32", progress=False)
    with pytest.raises(ModelLoadError, match="quantized by 'mxfp4'"):  # another family's mxfp4 is no gpt-oss
        ModelConfig.from_hf({**json.loads((mxfp4 / "config.json").read_text()), "model_type": "llama",
                             "architectures": ["LlamaForCausalLM"]})


# ---- harmony's tool calls: the commentary channel's messages to functions.NAME

TEMPLATE = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates" / "openai-gpt-oss-120b.jinja"
THINKING, PREAMBLE, ARGUMENTS = "The user wants the weather in Paris.", "Let me look.", {"city": "Paris"}
# what gpt-oss writes after its generation prompt (<|start|>assistant), as OpenAI's harmony format has it: the
# analysis, a commentary preamble to the user, then the call with its recipient and content type in the
# channel's header, ended by <|call|> (a stop token: the engine's text may end before it)
CALL_REPLY = (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>commentary<|message|>"
              f"{PREAMBLE}<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
              f"<|message|>{json.dumps(ARGUMENTS)}<|call|>")
# the served model's (shorter: each character of text is about a token of the tiny tokenizer), without the
# <|call|> that ends generation
SERVED_REPLY = ('<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>commentary '
                f'to=functions.get_weather <|constrain|>json<|message|>{json.dumps(ARGUMENTS)}')
ANSWER_REPLY = "<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."


def test_harmony_replies_split_into_reasoning_content_and_calls_whole_and_streamed():
    from hearth.reasoning import FORMATS
    from hearth.server.tools import ToolCallStream, tool_calling
    from hearth.tool_calls import PARSERS
    from test_tool_calls import TOOLS

    for text in (CALL_REPLY, CALL_REPLY.removesuffix("<|call|>")):
        reply = PARSERS["gpt_oss"](text, True)
        assert reply.valid_calls and reply.content == PREAMBLE
        assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [("get_weather", ARGUMENTS)]
        assert FORMATS["gpt_oss"].split(text)[0] == THINKING
        stream, content, arguments = ToolCallStream(tool_calling(TOOLS, "auto", None, "gpt_oss")), "", ""
        for end in [*range(0, len(text), 3), len(text)]:  # a few characters at a time: markers never leak
            delta = stream.delta(text[:end], end == len(text))
            content += delta.get("content", "")
            for item in delta.get("tool_calls", []):
                assert item["index"] == 0 and item.get("function", {}).get("name", "get_weather") == "get_weather"
                arguments += item["function"]["arguments"]
        assert (content, json.loads(arguments)) == (PREAMBLE, ARGUMENTS)
    answer = PARSERS["gpt_oss"](ANSWER_REPLY, True)
    assert (answer.content, answer.calls) == ("Sunny.", [])
    cut = PARSERS["gpt_oss"](CALL_REPLY.removesuffix("<|call|>")[:-3], True)  # cut short: no call, its text is content
    assert not cut.calls and cut.content == PREAMBLE + json.dumps(ARGUMENTS)[:-3]


def _add_harmony_tokens(folder: Path, chat_template: str | None = None) -> list[int]:
    """harmony's markers as tokens of their own in `folder`'s tokenizer (added, not special: their text
    stays in the decoded reply, as gpt-oss's special tokens' does with skip_special_tokens off), and
    `chat_template`; returns the markers' ids."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in HARMONY_MARKERS])
    tokenizer.chat_template = chat_template or tokenizer.chat_template
    tokenizer.save_pretrained(folder)
    return tokenizer.convert_tokens_to_ids(list(HARMONY_MARKERS))


def _served_folder(folder: Path, root: Path) -> tuple[Path, list[int]]:
    """The tiny gpt_oss with harmony's markers and gpt-oss's own chat template; the markers' ids."""
    if not TEMPLATE.exists():
        pytest.skip(f"real chat templates not found at {TEMPLATE.parent}")
    served = root / "served"
    served.mkdir()
    for f in folder.iterdir():
        (served / f.name).write_bytes(f.read_bytes())
    return served, _add_harmony_tokens(served, TEMPLATE.read_text())


def test_tool_calls_through_chat_responses_and_messages(folder, tmp_path, monkeypatch):
    """The served random gpt_oss, its output forced (a regex on every request, hooked where the server
    makes its sampling params) to SERVED_REPLY (each marker one token), then, once the tool's result is in the conversation, to
    ANSWER_REPLY; `--reasoning-parser gpt_oss` and the tool parser the template implies. Each API gives
    the call in its own shape, streamed or not (the six at once: one batch); the template renders the
    tools and the tool's result."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai

    from hearth.engine.async_engine import AsyncEngine
    from hearth.engine.engine import LLMEngine
    from hearth.engine_config import EngineConfig, ReasoningConfig
    from hearth.sampling_params import StructuredOutputsParams
    from hearth.server.app import build_app
    from hearth.server.served import ServedModel
    from test_server import serving
    from test_tool_calls import TOOLS, USER

    served, markers = _served_folder(folder, tmp_path)
    forced, plain = [SERVED_REPLY], ServedModel.reasoning_params
    # (the markers' own tokens preferred wherever the regex allows them: a reply of about 40 tokens, not 110)
    monkeypatch.setattr(ServedModel, "reasoning_params", lambda self, params: dataclasses.replace(
        plain(self, params), structured_outputs=StructuredOutputsParams(regex=re.escape(forced[0])),
        logit_bias=dict.fromkeys(markers, 100.0)))
    config = EngineConfig(reasoning=ReasoningConfig(parser="gpt_oss"))
    engine = AsyncEngine(LLMEngine(served, config, progress=False))
    try:
        with serving(build_app(engine, "gpt-oss")) as url, ThreadPoolExecutor(6) as pool:
            calls = [pool.submit(ask, url, TOOLS, USER) for ask in ASKS]
            got = [call.result() for call in calls]
            assert got == [("Hm.", "get_weather", ARGUMENTS)] * len(ASKS), got
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            call = {"id": "abcDEF123", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}
            messages = [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny, 21 degrees"}]
            forced[0] = ANSWER_REPLY
            answer = client.chat.completions.create(model="gpt-oss", messages=messages, tools=TOOLS).choices[0]
            assert (answer.message.reasoning_content, answer.message.content, answer.message.tool_calls,
                    answer.finish_reason) == ("It is sunny.", "Sunny.", None, "stop")
            tokens = httpx.post(url + "/tokenize", json={"model": "gpt-oss", "messages": messages, "tools": TOOLS}).json()
            prompt = httpx.post(url + "/detokenize", json={"model": "gpt-oss", "tokens": tokens["tokens"]}).json()["prompt"]
            assert "type get_weather = (_: {" in prompt  # the tools in harmony's TypeScript namespace
            assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                    f'{json.dumps(ARGUMENTS)}<|call|>') in prompt
            assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny, 21 degrees"' in prompt
    finally:
        engine.shutdown()


def _openai(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _claude(url: str, tools: list[dict]):
    import anthropic

    anthropic_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"]} for t in tools]
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0), anthropic_tools


def _chat(url: str, tools: list[dict], user: dict) -> tuple:
    res = _openai(url).chat.completions.create(model="gpt-oss", messages=[user], tools=tools)
    message, finish = res.choices[0].message, res.choices[0].finish_reason
    assert message.content is None and finish == "tool_calls" and len(message.tool_calls) == 1
    return message.reasoning_content, message.tool_calls[0].function.name, json.loads(message.tool_calls[0].function.arguments)


def _chat_streamed(url: str, tools: list[dict], user: dict) -> tuple:
    reasoning, arguments, names, finish = "", "", [], None
    for chunk in _openai(url).chat.completions.create(model="gpt-oss", messages=[user], tools=tools, stream=True):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        reasoning += getattr(delta, "reasoning_content", None) or ""
        assert not delta.content
        for call in delta.tool_calls or []:
            names += [call.function.name] if call.function.name else []
            arguments += call.function.arguments or ""
    assert finish == "tool_calls" and len(names) == 1
    return reasoning, names[0], json.loads(arguments)


def _responses(url: str, tools: list[dict], user: dict) -> tuple:
    flat = [{"type": "function", **t["function"]} for t in tools]
    r = _openai(url).responses.create(model="gpt-oss", input=[user], tools=flat)
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    return r.output[0].content[0].text, r.output[1].name, json.loads(r.output[1].arguments)


def _responses_streamed(url: str, tools: list[dict], user: dict) -> tuple:
    flat = [{"type": "function", **t["function"]} for t in tools]
    with _openai(url).responses.stream(model="gpt-oss", input=[user], tools=flat) as stream:
        done = [e.item for e in stream if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["reasoning", "function_call"]
    return done[0].content[0].text, done[1].name, json.loads(done[1].arguments)


def _messages(url: str, tools: list[dict], user: dict) -> tuple:
    claude, anthropic_tools = _claude(url, tools)
    m = claude.messages.create(model="gpt-oss", messages=[user], tools=anthropic_tools, max_tokens=300)
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    return m.content[0].thinking, m.content[1].name, m.content[1].input


def _messages_streamed(url: str, tools: list[dict], user: dict) -> tuple:
    claude, anthropic_tools = _claude(url, tools)
    with claude.messages.stream(model="gpt-oss", messages=[user], tools=anthropic_tools, max_tokens=300) as stream:
        m = stream.get_final_message()
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    return m.content[0].thinking, m.content[1].name, m.content[1].input


ASKS = (_chat, _chat_streamed, _responses, _responses_streamed, _messages, _messages_streamed)
