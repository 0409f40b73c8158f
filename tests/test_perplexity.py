"""hearth/perplexity.py: windows batched into one forward pass score as one at a time, and hearth's
perplexity of SmolLM2 equals llama.cpp's on the same windows (benchmarks/llamacpp_perplexity.py).
The comparison with transformers is in tests/test_cli.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hearth.cli import main
from hearth.loading.loader import load_model
from hearth.perplexity import perplexity
from models import make_hf_model
from optional import import_llama_cpp

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT.parent / "shared" / "data" / "models" / "smollm2-135m-instruct"
TEXT = "Once upon a time there was a little fox who lived in the forest. " * 8


def test_batched_windows_score_as_one_at_a_time(tmp_path):
    loaded = load_model(make_hf_model(tmp_path / "llama", "llama"), progress=False)
    ids = loaded.tokenizer.encode(TEXT)
    assert len(ids) > 5 * 24  # several windows, the last one short
    one_by_one = perplexity(loaded.model, ids, 24, torch.device("cpu"), max_batch_tokens=24)
    batched = perplexity(loaded.model, ids, 24, torch.device("cpu"), max_batch_tokens=1000)
    assert batched["tokens"] == one_by_one["tokens"]
    assert batched["nll"] == pytest.approx(one_by_one["nll"], rel=1e-5)


def test_smollm2_perplexity_equals_llama_cpp(tmp_path, capsys):
    """Both text files (1,429 tokens), windows of 512: what docs/benchmarks.md times."""
    model = SMOLLM2 / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not model.exists():
        pytest.skip(f"reference data not found: {model} (expected ../shared/data next to the repo)")
    import_llama_cpp()
    text = tmp_path / "text.txt"
    parts = [(SMOLLM2 / name).read_text(encoding="utf-8") for name in ("text-apache-2.0.txt", "text-json-decoder.py.txt")]
    text.write_text("".join(parts), encoding="utf-8")
    reference = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "llamacpp_perplexity.py"), str(model), str(text),
         "--context", "512", "--threads", str(torch.get_num_threads()), "--json"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    expected = json.loads(reference.stdout)
    assert main(["perplexity", str(model), "--text-file", str(text), "--context", "512", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == expected["tokens"]
    assert abs(result["perplexity"] - expected["perplexity"]) / expected["perplexity"] <= 0.005


def test_kl_divergence_from_a_reference_equals_transformers(tmp_path, capsys):
    """`hearth perplexity MODEL --kl-divergence REFERENCE`: the mean KL divergence and the share of rows
    whose top tokens agree, against the same windows through transformers and torch's kl_div; a model
    against itself: 0 and every row. A reference of another vocabulary: a clean error."""
    from models import load_hf_reference

    model, reference = (make_hf_model(tmp_path / name, "llama", seed=seed) for name, seed in (("a", 0), ("b", 1)))
    ids = load_model(model, progress=False).tokenizer.encode(TEXT)
    kld, same, count = 0.0, 0, 0
    with torch.no_grad():
        hf_model, hf_reference = load_hf_reference(model), load_hf_reference(reference)
        for start in range(0, len(ids) - 1, 24):
            window = torch.tensor([ids[start:start + 24]])
            if window.shape[1] < 2:
                break
            q = hf_model(window).logits[0, :-1].log_softmax(-1)
            p = hf_reference(window).logits[0, :-1].log_softmax(-1)
            kld += torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum").item()
            same += int((p.argmax(-1) == q.argmax(-1)).sum())
            count += window.shape[1] - 1
    assert main(["perplexity", str(model), "--text", TEXT, "--context", "24", "--kl-divergence", str(reference),
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == count and kld / count > 0.01
    assert result["kld"] == pytest.approx(kld / count, rel=1e-4)
    assert result["same_top"] == same / count
    assert main(["perplexity", str(model), "--text", TEXT, "--context", "24", "--kl-divergence", str(model),
                 "--json"]) == 0
    itself = json.loads(capsys.readouterr().out)
    assert abs(itself["kld"]) < 1e-6 and itself["same_top"] == 1.0
    other = make_hf_model(tmp_path / "other", "llama", vocab_size=1000)
    assert main(["perplexity", str(model), "--text", TEXT, "--kl-divergence", str(other)]) == 1
    assert "vocabulary" in capsys.readouterr().err
