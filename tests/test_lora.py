"""LoRA adapters: each adapter's greedy tokens and logprobs equal transformers + peft on the same base
(random adapters on a random llama in real head shapes), alone and mixed in one batch; a quantized
base; the prefix cache kept apart per adapter; bad adapters refused by name."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hearth import LLM, LoRARequest, SamplingParams
from hearth.errors import ModelLoadError, RequestError
from models import load_hf_reference, make_hf_model

# real head shapes (head_dim 64, grouped K/V), few layers
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
# (targets, r, lora_alpha, use_rslora): attention alone, the MLP alone, everything, part of a merged projection
ADAPTERS = {
    "attn": (["q_proj", "k_proj", "v_proj", "o_proj"], 8, 16, False),
    "mlp": (["gate_proj", "up_proj", "down_proj"], 4, 8, False),
    "all": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16, 8, True),
    "qv": (["q_proj", "v_proj"], 2, 4, False),
}
MAX_TOKENS = 6


def make_adapter(base, folder, targets, rank, alpha, rslora, seed):
    """A PEFT adapter with random A and B (PEFT starts B at zero: that would add nothing)."""
    import peft  # here, not at the top: 5 s of CPU for each pytest worker that collects this file

    model = peft.get_peft_model(load_hf_reference(base), peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_hf_model(root / "base", "llama", **SHAPE)
    adapters = {name: make_adapter(base, root / name, *spec, seed=i + 1) for i, (name, spec) in enumerate(ADAPTERS.items())}
    return base, adapters


@pytest.fixture(scope="module")
def llm(base_and_adapters):
    base, adapters = base_and_adapters
    return LLM(str(base), enable_lora=True, max_loras=4, lora_modules=[f"{n}={p}" for n, p in list(adapters.items())[:2]],
               kv_cache_memory=1 << 24, progress=False)


def reference(base, adapter, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """transformers (+ peft) on prompt + tokens: the greedy choice after each and its logprob. base: the
    base model's folder, or the model itself."""
    model = load_hf_reference(base) if not isinstance(base, torch.nn.Module) else base
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.argmax(-1).tolist(), logprobs.max(-1).values.tolist()


def check_against_reference(base, adapter, prompt, output) -> None:
    tokens = list(output.token_ids)
    expected, expected_logprobs = reference(base, adapter, prompt, tokens)
    assert tokens == expected
    for entry, token, lp in zip(output.logprobs, tokens, expected_logprobs):
        assert entry[token] == pytest.approx(lp, abs=2e-4)


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)


def test_each_adapter_alone_and_mixed_equals_peft(llm, base_and_adapters):
    base, adapters = base_and_adapters
    prompts = [[(7 * i + 3 * j) % 300 + 2 for j in range(11 + i)] for i in range(6)]
    # alone: one adapter per generate call (the two given at start, two loaded by their first request)
    for i, name in enumerate(adapters):
        out = llm.generate([prompts[i]], PARAMS, use_tqdm=False, lora_request=LoRARequest(name, i + 1, str(adapters[name])))
        check_against_reference(base, adapters[name], prompts[i], out[0].outputs[0])
    # mixed: the 4 adapters and two plain requests in one batch
    loras = [LoRARequest(name, 0, str(adapters[name])) for name in adapters] + [None, None]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs):
        check_against_reference(base, None if lora is None else adapters[lora.lora_name], prompt, out.outputs[0])
    # the adapters change the answers (so that the comparisons above could fail)
    plain = llm.generate([prompts[0]] * 2, PARAMS, use_tqdm=False, lora_request=[None, loras[0]])
    assert plain[0].outputs[0].logprobs != plain[1].outputs[0].logprobs


def test_prefix_cache_keeps_adapters_apart(llm, base_and_adapters):
    _, adapters = base_and_adapters
    prompt = list(range(2, 60))  # several full blocks
    attn = LoRARequest("attn", 0, str(adapters["attn"]))
    first = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=attn)[0]
    manager = llm.engine.block_manager
    hits = manager.prefix_cache_hits
    again = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=attn)[0]
    assert manager.prefix_cache_hits > hits and again.outputs[0].token_ids == first.outputs[0].token_ids
    hits = manager.prefix_cache_hits
    other = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=LoRARequest("mlp"))[0]
    plain = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert manager.prefix_cache_hits == hits  # neither met the attn adapter's blocks
    assert other.outputs[0].logprobs != first.outputs[0].logprobs != plain.outputs[0].logprobs


def test_unload_and_reload(llm, base_and_adapters):
    _, adapters = base_and_adapters
    for name in ADAPTERS:  # (the start loads two; which of the file's tests loaded the others, xdist decides)
        llm.engine.add_lora(LoRARequest(name, 0, str(adapters[name])))
    names = {a.name for a in llm.engine.list_loras()}
    assert names == set(ADAPTERS)
    with pytest.raises(RequestError, match="max_loras"):
        llm.engine.add_lora(LoRARequest("fifth", 0, str(adapters["qv"])))
    llm.engine.remove_lora("qv")
    with pytest.raises(RequestError, match="no LoRA adapter named 'qv'"):
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, lora_request=LoRARequest("qv"))
    with pytest.raises(RequestError, match="no LoRA adapter named 'qv'"):
        llm.engine.remove_lora("qv")
    llm.engine.add_lora(LoRARequest("qv", 0, str(adapters["qv"])))


def _broken(adapters, tmp_path, name, edit):
    import shutil

    folder = tmp_path / name
    shutil.copytree(adapters["qv"], folder)
    edit(folder)
    return folder


def _edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return edit


def _edit_tensors(change):
    def edit(folder):
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "adapter_model.safetensors")
        save_file(change(tensors), folder / "adapter_model.safetensors")
    return edit


@pytest.mark.parametrize("name, edit, message", [
    ("missing", lambda f: (f / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    ("dora", _edit_config(use_dora=True), "use_dora=True is not implemented"),
    ("saved", _edit_config(modules_to_save=["lm_head"]), "modules_to_save"),
    ("bias", _edit_config(bias="all"), "bias='all' is not implemented"),
    ("rank", _edit_config(r=3), "do not have the rank r=3"),
    ("shape", _edit_tensors(lambda t: {k: v[:, :-1].contiguous() if "lora_A" in k else v for k, v in t.items()}),
     "expected .* for this model"),
    ("module", _edit_tensors(lambda t: {k.replace("q_proj", "q_rot"): v for k, v in t.items()}),
     "target module model.layers.0.self_attn.q_rot is not one hearth adapts"),
])
def test_bad_adapters_are_refused_by_name(llm, base_and_adapters, tmp_path, name, edit, message):
    _, adapters = base_and_adapters
    folder = _broken(adapters, tmp_path, name, edit)
    with pytest.raises(ModelLoadError, match=message):
        llm.engine.add_lora(LoRARequest(f"bad-{name}", 0, str(folder)))
    assert f"bad-{name}" not in {a.name for a in llm.engine.list_loras()}


# the base's format in the GGUF, its module on the cpu backend, and how far logprobs may be from transformers +
# peft on the dequantized weights: F16 weights are widened to float32 exactly (only the sums' order differs); the
# int8 kernels round activations to 8 bits (docs/quantized-matmul.md: the base alone is off by up to 0.07 here,
# far below what the adapters move)
BASES = {"f16": ("HalfLinear", 2e-4), "q8_0": ("Int8Linear", 0.1)}


def rounded_adapter(folder, dtype, into):
    """A copy of the PEFT adapter in `folder` with its matrices rounded to `dtype` (kept float32)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    tensors = load_file(into / "adapter_model.safetensors")
    save_file({k: v.to(dtype).float() for k, v in tensors.items()}, into / "adapter_model.safetensors")
    return into


@pytest.mark.parametrize("out_type, lora_dtype", [("f16", "auto"), ("q8_0", "auto"), ("f16", "bfloat16")])
def test_stored_base_equals_dequantized_reference(base_and_adapters, tmp_path, monkeypatch, out_type, lora_dtype):
    """hearth convert to F16 or Q8_0, then the adapters, one alone and the four mixed with a plain request in one
    batch: against transformers + peft on the dequantized weights (transformers reads the GGUF itself, dequantizing
    with gguf's own code); with lora_dtype bfloat16, against peft with the adapters rounded to bfloat16. Their decode
    steps run the cpu backend's whole-layer kernels, the adapters' terms in them."""
    import transformers

    from hearth.backend.cpu_decode import CpuDecodePath
    from hearth.loading.convert import convert_hf_to_gguf

    base, adapters = base_and_adapters
    module, tolerance = BASES[out_type]
    gguf_file = convert_hf_to_gguf(base, tmp_path / f"base-{out_type}.gguf", out_type, progress=False)
    llm = LLM(str(gguf_file), lora_modules=[f"{n}={p}" for n, p in adapters.items()], lora_dtype=lora_dtype,
              kv_cache_memory=1 << 24, progress=False)
    assert type(llm.engine.model.layers[0].mlp.down_proj.lora_base).__name__ == module
    if lora_dtype != "auto":
        adapters = {n: rounded_adapter(p, getattr(torch, lora_dtype), tmp_path / n) for n, p in adapters.items()}
    kernel_steps = []  # (rows with an adapter, whether the kernel ran the step) of each decode step
    run = CpuDecodePath.__call__
    monkeypatch.setattr(CpuDecodePath, "__call__", lambda path, x, *args: kernel_steps.append(
        (int((path.lora_rows.row_slots >= 0).sum()) if path.lora_rows.active else 0,
         (out := run(path, x, *args)) is not None)) or out)
    prompts = [list(range(3 + i, 20 + 2 * i)) for i in range(5)]
    alone = llm.generate(prompts[:1], PARAMS, use_tqdm=False, lora_request=LoRARequest("all"))
    loras = [LoRARequest(name) for name in adapters] + [None]
    outs = alone + llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    assert (1, True) in kernel_steps and (4, True) in kernel_steps and all(ran for _, ran in kernel_steps)
    dequantized = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_file.name,
                                                                    torch_dtype=torch.float32)
    for prompt, lora, out in zip(prompts[:1] + prompts, loras[2:3] + loras, outs):
        out = out.outputs[0]
        expected, logprobs = reference(copy.deepcopy(dequantized), lora and adapters[lora.lora_name], prompt,
                                       list(out.token_ids))  # (peft wraps the model it is given in place)
        assert list(out.token_ids) == expected
        assert [e[t] for e, t in zip(out.logprobs, out.token_ids)] == pytest.approx(logprobs, abs=tolerance)
    assert outs[0].outputs[0].token_ids != outs[-1].outputs[0].token_ids  # the adapter changes the answer


def test_adapters_in_a_server_of_several_models(llm, base_and_adapters):
    """`hearth serve --model base=... --model other=builtin --lora attn=...`: an adapter's name routes to its
    model, one loaded at run time too (`model` in the load's body), and both come back with their model
    after it was unloaded for the other one (--max-loaded-models 1)."""
    import httpx
    import openai

    from hearth.cli import build_parser
    from hearth.fleet.model_app import build_models_app, models_from_args
    from hearth.server.limits import ServerLimits
    from test_server import serving

    base, adapters = base_and_adapters
    prompt = [5, 9, 17, 33, 65, 129, 200]
    offline = {name: llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=LoRARequest(name))[0].outputs[0].text
               for name in ("attn", "mlp")}
    args = build_parser().parse_args(["serve", "--model", f"base={base}", "--model", "other=builtin", "--lora",
                                      f"attn={adapters['attn']}", "--kv-cache-memory", "16MiB", "--max-loaded-models", "1"])
    with serving(build_models_app(models_from_args(args, ServerLimits()), 8)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def text(model: str) -> str:
            reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert reply.model == model
            return reply.choices[0].text

        assert text("attn") == offline["attn"]
        loaded = httpx.post(url + "/v1/load_lora_adapter",
                            json={"model": "base", "lora_name": "mlp", "lora_path": str(adapters["mlp"])})
        assert loaded.status_code == 200, loaded.text
        parents = {m.id: m.parent for m in client.models.list().data}
        assert parents == {"base": None, "attn": "base", "mlp": "base", "other": None}
        assert text("other")  # base unloaded for it
        assert text("mlp") == offline["mlp"] and text("attn") == offline["attn"]


def test_adapter_loads_reach_every_replica_behind_the_router(llm, base_and_adapters):
    """Behind `--data-parallel-size`'s router (random routing), a load and an unload reach both replicas:
    each lists the adapter and serves it with the offline engine's greedy text; after the unload, neither."""
    import httpx
    import openai

    from hearth.engine.async_engine import AsyncEngine
    from hearth.fleet.router import Router, build_router_app
    from hearth.server.app import build_app
    from test_distributed import FixedReplicas
    from test_server import serving

    base, adapters = base_and_adapters
    prompt = [5, 9, 17, 33, 65, 129, 200]
    offline = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=LoRARequest("mlp"))[0].outputs[0].text
    engines = [AsyncEngine(LLM(str(base), enable_lora=True, max_loras=4, kv_cache_memory=1 << 24, progress=False).engine)
               for _ in range(2)]
    try:
        with serving(build_app(engines[0], "base")) as a, serving(build_app(engines[1], "base")) as b:
            router = Router(FixedReplicas([a, b]), policy="random")
            with serving(build_router_app(router)) as url:
                body = {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}
                assert httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
                for replica in (a, b):
                    assert "mlp" in {m["id"] for m in httpx.get(replica + "/v1/models").json()["data"]}
                client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
                texts = {client.completions.create(model="mlp", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True}).choices[0].text for _ in range(4)}
                assert texts == {offline}
                again = httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=60)
                assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
                assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
                for replica in (a, b):
                    assert "mlp" not in {m["id"] for m in httpx.get(replica + "/v1/models").json()["data"]}
    finally:
        for engine in engines:
            engine.shutdown()


def test_load_and_unload_endpoints_and_model_names(llm, base_and_adapters):
    """Last in this file: the module's engine is then the server's. Through httpx and the openai SDK."""
    import httpx
    import openai

    from hearth.engine.async_engine import AsyncEngine
    from hearth.server.app import build_app
    from test_server import serving

    _, adapters = base_and_adapters
    for name in ADAPTERS:  # (whichever of the file's tests this worker ran before: every adapter loaded)
        llm.engine.add_lora(LoRARequest(name, 0, str(adapters[name])))
    prompt = [5, 9, 17, 33, 65, 129, 200]
    offline = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=LoRARequest("qv"))[0].outputs[0].text
    engine = AsyncEngine(llm.engine)
    with serving(build_app(engine, "base")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"base", *ADAPTERS}
        assert listed["qv"].parent == "base" and listed["base"].parent is None
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 200
        assert "qv" not in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="qv", prompt=prompt, max_tokens=2)
        missing = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
        assert missing.status_code == 400 and "is not a folder" in missing.json()["error"]["message"]
        again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": str(adapters["qv"])})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
        loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(adapters["qv"])})
        assert loaded.status_code == 200, loaded.text
        reply = client.completions.create(model="qv", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.model == "qv" and reply.choices[0].text == offline
        chat = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.model == "attn"
        with pytest.raises(openai.BadRequestError, match="LoRA adapter"):
            client.embeddings.create(model="attn", input="hi")
    engine.shutdown()
