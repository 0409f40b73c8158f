"""/v1/embeddings through OpenAI's client against tiny random models, checked against
transformers' final hidden states of the same weights, pooled as the family expects."""

from __future__ import annotations

import threading

import numpy as np
import openai
import pytest
import torch

from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.server.app import build_app
from models import load_hf_reference, make_hf_model
from test_server import serving

TEXTS = ["Once upon a time there was a fox.", "def fibonacci(n):", "ü"]


@pytest.fixture(scope="module", params=[("llama", "last"), ("gemma", "mean")], ids=["llama-last", "gemma-mean"])
def served(request, tmp_path_factory):
    arch, pooling = request.param
    folder = make_hf_model(tmp_path_factory.mktemp(f"embed-{arch}") / arch, arch)
    # a small KV cache and token budget: batches of inputs borrow and return blocks
    engine = AsyncEngine(LLMEngine(folder, EngineConfig.from_options(max_num_batched_tokens=32, kv_cache_memory=2**20),
                                   progress=False))
    with serving(build_app(engine, "tiny")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), engine, folder, pooling
    engine.shutdown()


def reference(folder, ids: list[int], pooling: str) -> np.ndarray:
    model = load_hf_reference(folder)
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector, dim=0).numpy()


def test_embeddings_equal_transformers_pooled_hidden_states(served):
    client, engine, folder, pooling = served
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    res = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64
    assert [d.index for d in res.data] == [0, 1, 2]
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    for d, token_ids in zip(res.data, ids):
        np.testing.assert_allclose(d.embedding, reference(folder, token_ids, pooling), atol=2e-5)
    floats = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, res.data[0].embedding, atol=1e-6)
    by_ids = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, res.data[1].embedding, atol=1e-6)
    batch = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in batch.data], [d.embedding for d in res.data], atol=1e-6)


def test_embedding_while_generating_leaves_the_generation_and_the_cache_alone(served):
    client, engine, _, _ = served
    prompt = "Once upon a time"
    expected = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    done = threading.Event()

    def embed_meanwhile():
        while not done.is_set():
            client.embeddings.create(model="tiny", input=TEXTS)

    thread = threading.Thread(target=embed_meanwhile)
    thread.start()
    try:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    finally:
        done.set()
        thread.join()
    assert got == expected
    assert engine.engine.block_manager.check_all_free()


@pytest.mark.parametrize("body,message", [
    ({"input": []}, "must not be empty"),
    ({"input": [[1, 2], [99999]]}, "outside the vocabulary"),
    ({"input": "hi", "dimensions": 8}, "dimensions is not supported"),
    ({"input": list(range(3, 300)) * 2}, "context window"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_embedding_requests_are_400s(served, body, message):
    client = served[0]
    with pytest.raises(openai.BadRequestError, match=message):
        client.embeddings.create(model="tiny", **body)
