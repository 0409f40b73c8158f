"""The built-in model (MODEL `builtin`): it runs end to end, and it has really learned Python."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from hearth.cli import main
from hearth.default_model import builtin_model_path

pytestmark = pytest.mark.skipif(not builtin_model_path().exists(), reason="the built-in model is not built")


def test_generate_with_the_built_in_model_by_name(capsys):
    assert main(["generate", "builtin", "--prompt", "def fibonacci(n):", "--max-tokens", "24", "--temperature", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completion_tokens"] > 0
    assert any(mark in result["text"] for mark in ("(", ":", "=", "return", "self"))


def test_it_predicts_held_out_standard_library_code(capsys):
    """An untrained model scores about its vocabulary size; this one must do far better."""
    # asyncio/runners.py is among the files the recipe holds out (a hash of the path decides)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "asyncio" / "runners.py").read_text()[:6000]
    assert main(["inspect", "builtin", "--json"]) == 0
    vocab_size = json.loads(capsys.readouterr().out)["vocab_size"]
    assert main(["perplexity", "builtin", "--text", text, "--context", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["perplexity"] < vocab_size / 50
