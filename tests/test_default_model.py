"""The built-in model: every command falls back to it, and it has really learned Python."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from hearth.cli import main
from hearth.llm import default_model_path

pytestmark = pytest.mark.skipif(not default_model_path().exists(), reason="the built-in model is not built")


def test_generate_without_a_model_uses_the_built_in_one(capsys):
    assert main(["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "24", "--temperature", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completion_tokens"] > 0
    assert any(mark in result["text"] for mark in ("(", ":", "=", "return", "self"))


def test_it_predicts_held_out_standard_library_code(capsys):
    """An untrained model scores about its vocabulary size; this one must do far better."""
    # asyncio/runners.py is among the files the recipe holds out (a hash of the path decides)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "asyncio" / "runners.py").read_text()[:6000]
    assert main(["inspect", str(default_model_path()), "--json"]) == 0
    vocab_size = json.loads(capsys.readouterr().out)["vocab_size"]
    assert main(["perplexity", str(default_model_path()), "--text", text, "--context", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["perplexity"] < vocab_size / 50
