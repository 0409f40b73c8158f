"""The default model's corpus (recipes/train_default_model.py, steps 1 to 3): the Python standard
library's .py files split into training and held-out files, chat examples from docstrings, the
byte-level BPE tokenizer, and the documents packed into fixed-length rows."""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
import textwrap
from pathlib import Path

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]  # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MAX_FILE_BYTES = 200_000
HELDOUT_PER_MILLE = 20  # 2% of the files


# ---------------------------------------------------------------- data


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path | None = None, max_bytes: int = MAX_FILE_BYTES) -> list[str]:
    """Relative paths (POSIX, sorted) of the standard library's .py files: no site-packages,
    none larger than `max_bytes`."""
    root = root or stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts or not path.is_file():
            continue
        if path.stat().st_size > max_bytes:
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel: str, per_mille: int = HELDOUT_PER_MILLE) -> bool:
    """Held out for evaluation or not: a hash of the relative path, the same on every machine."""
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big") % 1000 < per_mille


def split_files(rels: list[str], per_mille: int = HELDOUT_PER_MILLE) -> tuple[list[str], list[str]]:
    train = [r for r in rels if not is_heldout(r, per_mille)]
    heldout = [r for r in rels if is_heldout(r, per_mille)]
    return train, heldout


def is_test_file(rel: str) -> bool:
    """A file of the stdlib's own test suites (test/, tests/, idle_test/ folders, test_*.py)."""
    parts = rel.split("/")
    return any(p in ("test", "tests", "idle_test") for p in parts[:-1]) or parts[-1].startswith("test_")


def read_texts(root: Path, rels: list[str]) -> tuple[dict[str, str], list[str]]:
    """{rel: text} for the files that are UTF-8, and the list of those skipped (not UTF-8)."""
    texts, skipped = {}, []
    for rel in rels:
        try:
            texts[rel] = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
    return texts, skipped


CHAT_REQUESTS = (
    "{doc}",
    "Write a Python function that does this: {doc}",
    "Write a Python function `{name}`. {doc}",
)


def chat_examples(texts: dict[str, str], seed: int, max_source_chars: int = 1500) -> list[list[dict]]:
    """Conversations made from functions with docstrings: the docstring's first paragraph (in one
    of a few phrasings) is the user's request, the function's source in a ```python block the
    assistant's answer. Test functions, very long functions and repeated docstrings are left out."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out = []
    for rel in sorted(texts):
        text = texts[rel]
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("test"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            para = " ".join(doc.strip().split("\n\n")[0].split())
            if not 20 <= len(para) <= 300 or para in seen:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            source = textwrap.dedent("\n".join(lines[start : node.end_lineno])).strip("\n")
            if len(source) > max_source_chars or not source.lstrip().startswith(("def ", "async def ", "@")):
                continue
            seen.add(para)
            request = rng.choice(CHAT_REQUESTS).format(doc=para, name=node.name)
            out.append([{"role": "user", "content": request},
                        {"role": "assistant", "content": f"```python\n{source}\n```"}])
    return out


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenizer regex), special tokens first (ids 0..2); encoding with
    special tokens prepends <|endoftext|> as BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    eot_id = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B:1", special_tokens=[(EOT, eot_id)])
    return tok


def hf_tokenizer(tok, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
        additional_special_tokens=[IM_START, IM_END], model_max_length=model_max_length,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(hf, folder: Path) -> None:
    hf.save_pretrained(folder)
    # say plainly what tokenizer.json's post-processor does, for readers of tokenizer_config.json only
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=True, add_eos_token=False, chat_template=CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(folder: Path):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    if hf.chat_template is None:
        hf.chat_template = CHAT_TEMPLATE
    return hf


def pack_documents(docs: list[list[int]], eot_id: int, seq_len: int, seed: int):
    """Shuffle the documents (seeded), join them as <|endoftext|> doc <|endoftext|> doc ...,
    cut into rows of seq_len tokens (the tail that does not fill a row is dropped)."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(docs))
    total = sum(len(d) + 1 for d in docs)
    stream = np.empty(total, dtype=np.int32)
    i = 0
    for j in order:
        stream[i] = eot_id
        stream[i + 1 : i + 1 + len(docs[j])] = docs[j]
        i += 1 + len(docs[j])
    rows = total // seq_len
    return stream[: rows * seq_len].reshape(rows, seq_len)
