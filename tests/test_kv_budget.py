"""`hearth inspect` and the engine agree on the KV cache: its dtype (the engine's compute dtype with
--kv-cache-dtype auto: float32 on a CPU) and its default budget (max_num_seqs contexts, capped on a CPU
by 4x the weights' bytes), both checked against sizes read from the GGUF file by the gguf package."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from hearth import LLM
from hearth.default_model import builtin_model_path
from hearth.engine.memory import kv_cache_blocks, kv_cache_budget
from hearth.model_info import model_info

BLOCK_SIZE = 16  # EngineConfig's default
SMOLLM2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"


def kv_bytes_per_token(path: Path, element_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head_dim x bytes, from the file's own metadata."""
    reader = gguf.GGUFReader(path)

    def field(key: str) -> int:
        value = reader.fields[key]
        return int(value.parts[value.data[0]][0])

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    heads = field(f"{arch}.attention.head_count")
    head_dim = field(f"{arch}.embedding_length") // heads
    return 2 * field(f"{arch}.block_count") * field(f"{arch}.attention.head_count_kv") * head_dim * element_bytes


def engine_element_bytes() -> int:
    return 2 if torch.cuda.is_available() else 4  # bfloat16 on a GPU, float32 on a CPU


def test_inspect_reports_the_kv_dtype_the_engine_uses():
    path = builtin_model_path()
    info = model_info(path)
    engine = LLM(str(path), progress=False).engine
    assert info["kv_cache_dtype"] == engine.kv_cache_dtype == ("bfloat16" if torch.cuda.is_available() else "float32")
    assert info["kv_bytes_per_element"] == engine_element_bytes()
    assert info["kv_cache_bytes_per_token"] == kv_bytes_per_token(path, engine_element_bytes())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's default budget")
def test_the_default_budget_fits_the_model_and_inspect_says_the_same():
    """The built-in model (10.9 MB): 256 contexts would want far more; the cap is 4x its file."""
    path = builtin_model_path()
    per_token = kv_bytes_per_token(path, 4)
    expected_blocks = 4 * path.stat().st_size // (per_token * BLOCK_SIZE)
    engine = LLM(str(path), progress=False).engine
    assert engine.num_blocks == expected_blocks
    assert engine.kv_cache_bytes == expected_blocks * BLOCK_SIZE * per_token
    info = model_info(path)
    assert info["kv_budget_default"]
    assert (info["kv_budget_tokens"], info["kv_budget_bytes"]) == (engine.kv_cache_tokens, engine.kv_cache_bytes)


@pytest.mark.skipif(not SMOLLM2.exists(), reason=f"SmolLM2's file not found: {SMOLLM2}")
def test_smollm2_default_budget_is_a_context_not_four_gib():
    """The issue's case: `hearth serve` on SmolLM2 (98 MB) took 4 GiB, 93,200 tokens; on a CPU the cap is
    now 4x the file, a little more than one 8,192-token context."""
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M's config.json: 30 layers, 3 KV heads of 64; float32
    file_bytes = SMOLLM2.stat().st_size
    budget = kv_cache_budget(torch.device("cpu"), per_token, BLOCK_SIZE, 8192, 256, file_bytes)
    tokens = kv_cache_blocks(budget, per_token, BLOCK_SIZE) * BLOCK_SIZE
    assert tokens == 4 * file_bytes // (per_token * BLOCK_SIZE) * BLOCK_SIZE
    assert 8192 < tokens < 10_000


def test_a_budget_given_is_counted_in_tokens_of_the_engine_dtype():
    path = builtin_model_path()
    info = model_info(path, kv_budget_bytes=1 << 20)
    assert not info["kv_budget_default"]
    assert info["kv_budget_tokens"] == (1 << 20) // kv_bytes_per_token(path, engine_element_bytes())
