"""The default-model recipe's pieces (recipes/train_default_model.py): fast checks, no training."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "train_default_model.py"


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("train_default_model", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SOURCE = '''
import math


def gcd(a, b):
    """Return the greatest common divisor of a and b.

    More words that are not part of the request.
    """
    while b:
        a, b = b, a % b
    return a


class Box:
    def area(self):
        """Compute the area of the box from its sides."""
        return self.w * self.h

    def test_nothing(self):
        """A test function that must not become a chat example."""
'''


def test_file_listing_skips_site_packages_and_big_files(recipe, tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "site-packages" / "x").mkdir(parents=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not python\n")
    (tmp_path / "site-packages" / "x" / "c.py").write_text("z = 3\n")
    (tmp_path / "big.py").write_text("#" * 5000)
    assert recipe.list_stdlib_files(tmp_path, max_bytes=4000) == ["a.py", "pkg/sub/b.py"]


def test_heldout_split_is_deterministic_and_about_two_percent(recipe):
    rels = [f"pkg{i // 50}/module_{i}.py" for i in range(5000)]
    train, heldout = recipe.split_files(rels)
    assert (train, heldout) == recipe.split_files(list(rels))
    assert sorted(train + heldout) == sorted(rels) and not set(train) & set(heldout)
    assert 0.01 < len(heldout) / len(rels) < 0.03
    # the split depends on the path alone: the same file is held out whatever else is listed
    assert all(recipe.is_heldout(r) for r in heldout)
    assert recipe.split_files(heldout)[1] == heldout


def test_real_stdlib_split(recipe):
    rels = recipe.list_stdlib_files()
    assert len(rels) > 500 and rels == sorted(rels)
    assert not any("site-packages" in r for r in rels)
    train, heldout = recipe.split_files(rels)
    assert 0.01 < len(heldout) / len(rels) < 0.04


def test_chat_examples_from_docstrings(recipe):
    convs = recipe.chat_examples({"m.py": SOURCE}, seed=0)
    assert len(convs) == 2
    requests = [c[0]["content"] for c in convs]
    assert any("Return the greatest common divisor of a and b." in r for r in requests)
    assert not any("More words" in r for r in requests)
    answer = next(c[1]["content"] for c in convs if "greatest" in c[0]["content"])
    assert answer.startswith("```python\ndef gcd(a, b):\n") and answer.endswith("return a\n```")
    method = next(c[1]["content"] for c in convs if "area" in c[0]["content"])
    assert method.startswith("```python\ndef area(self):\n    \"\"\"")  # dedented
    assert recipe.chat_examples({"m.py": SOURCE}, seed=0) == convs


def test_tokenizer_training_special_tokens_bos_and_chat_template(recipe, tmp_path):
    texts = [SOURCE * 3, "def f(x):\n    return x + 1\n" * 20, "import os\nprint(os.getcwd())\n" * 10]
    tok = recipe.train_tokenizer(texts, vocab_size=400)
    assert [tok.token_to_id(t) for t in recipe.SPECIAL_TOKENS] == [0, 1, 2]
    again = recipe.train_tokenizer(texts, vocab_size=400)
    assert again.to_str() == tok.to_str()  # deterministic: the draft model can share it

    hf = recipe.hf_tokenizer(tok, model_max_length=512)
    recipe.save_tokenizer(hf, tmp_path)
    loaded = recipe.load_tokenizer(tmp_path)
    text = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n"
    ids = loaded(text)["input_ids"]
    assert ids[0] == 0 and 0 not in ids[1:]  # <|endoftext|> as BOS, once
    assert loaded.decode(ids, skip_special_tokens=True) == text
    assert loaded.eos_token == loaded.bos_token == "<|endoftext|>"

    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = loaded(chat, add_special_tokens=False)["input_ids"]
    assert chat_ids.count(1) == 2 and chat_ids.count(2) == 1  # special tokens, not split into bytes


def test_packing_and_schedule(recipe):
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    rows = recipe.pack_documents(docs, eot_id=0, seq_len=4, seed=0)
    assert rows.shape == (3, 4)  # 12 tokens: 9 + 3 separators
    flat = rows.reshape(-1).tolist()
    assert flat.count(0) == 3 and flat[0] == 0 and sorted(flat) == sorted([0, 0, 0] + sum(docs, []))
    assert (recipe.pack_documents(docs, 0, 4, seed=0) == rows).all()

    peak = 1e-3
    lrs = [recipe.lr_at(s, 100, peak, warmup=10) for s in range(100)]
    assert lrs[0] == pytest.approx(peak / 10) and lrs[9] == pytest.approx(peak)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1 * peak, rel=0.05)
