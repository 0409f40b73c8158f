"""What the tests of the Responses and Messages APIs share: SmolLM2 served live on a free port,
its chat completions as the reference, the tools they call."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from hearth.engine_config import CacheConfig, EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.server.app import build_app
from test_server import serving

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct"
GGUF = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smollm2 = pytest.mark.skipif(not GGUF.exists(), reason=f"reference data not found: {DATA}")
API_KEY = "sk-hearth-agents"
NAME = "smollm2"

# closed schemas, so that a constrained call ends when its arguments do
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC", "PST"]}},
        "required": ["zone"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    """The base URL of SmolLM2 served with API_KEY (a test module imports this fixture)."""
    # no prefix cache: every prompt is computed whole, so the same conversation gives the same tokens
    # through any API (a cached prefix changes the sums a little, and SmolLM2's replies have near ties)
    engine = AsyncEngine(LLMEngine(GGUF, EngineConfig(cache=CacheConfig(enable_prefix_caching=False)), progress=False))
    try:
        with serving(build_app(engine, NAME, api_key=API_KEY)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)


def chat_reply(client: openai.OpenAI, messages: list[dict], **kw):
    """The reference: chat completions at temperature 0 on the same conversation."""
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, **kw)


def reasoning_then_text() -> list:
    """The block events of a reply of reasoning, then text, fed as chat completions' deltas carry them
    (`reasoning_content`, `content`): the input both APIs' reasoning tests shape into their events."""
    from hearth.server.turns import Blocks

    blocks = Blocks()
    changes = blocks.feed({"reasoning_content": "Paris, surely."}) + blocks.feed({"content": "Paris."}) + blocks.stop()
    assert [(e.type, e.index, e.block.kind) for e in changes] == [
        ("start", 0, "reasoning"), ("delta", 0, "reasoning"), ("stop", 0, "reasoning"),
        ("start", 1, "text"), ("delta", 1, "text"), ("stop", 1, "text")]
    return changes
