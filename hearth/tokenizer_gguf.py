"""GGUF tokenizer metadata (llama.cpp's `tokenizer.ggml.*` keys) -> a `tokenizers` backend, and
the byte alphabets both kinds of tokenizer decode with (hearth/tokenizer.py has the whole story:
which GGUF tokenizer models are supported and how each is rebuilt).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import tokenizers

from hearth.errors import ModelLoadError

logger = logging.getLogger(__name__)

# GGUF tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space


# ---------------------------------------------------------------- byte-level alphabet (GPT-2)

def _byte_alphabet() -> list[str]:
    """The printable character GPT-2's byte-level BPE writes for each byte 0..255."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


BYTE_CHARS = _byte_alphabet()
BYTE_OF_CHAR = {c: b for b, c in enumerate(BYTE_CHARS)}


# alphabet character -> the character of its byte (latin-1); the few characters at or below 0xFF
# that are not in the alphabet and differ in UTF-8 map out of range, to take the slow path
_TO_LATIN1 = {**{ord(c): b for c, b in BYTE_OF_CHAR.items()},
              **{c: 0x100 for c in [*range(0x80, 0xA1), 0xAD] if chr(c) not in BYTE_OF_CHAR}}


def byte_level_bytes(piece: str) -> bytes:
    """Bytes of a byte-level piece; characters outside the alphabet stand for themselves (as the library does)."""
    try:
        return piece.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(bytes((BYTE_OF_CHAR[c],)) if c in BYTE_OF_CHAR else c.encode() for c in piece)


def byte_level_spelling(text: str) -> str:
    return "".join(BYTE_CHARS[b] for b in text.encode())


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def spm_bytes(piece: str) -> bytes:
    """Bytes of a SentencePiece piece: `<0xNN>` is that byte, "▁" is a space."""
    m = _BYTE_TOKEN.fullmatch(piece)
    if m:
        return bytes((int(m.group(1), 16),))
    return piece.replace(SPIECE_SPACE, " ").encode()


# ---------------------------------------------------------------- pre-tokenizers by tokenizer.ggml.pre

def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_DIGITS = {"type": "Digits", "individual_digits": True}

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_CJK = r"[一-龥ࠀ-一가-퟿]+"
# deepseek-llm spells out its letters (cased letters, as ranges of code points) rather than \p{L}.
_DEEPSEEK_LLM_CASED = (
    "41-5A 61-7A B5 C0-D6 D8-F6 F8-1BA 1BC-1BF 1C4-293 295-2AF 370-373 376-377 37B-37D 37F 386 388-38A 38C "
    "38E-3A1 3A3-3F5 3F7-481 48A-52F 531-556 10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B "
    "1D6B-1D77 1D79-1D9A 1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 "
    "1FB6-1FBC 1FBE 1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 "
    "2115 2119-211D 2124 2126 2128 212A-212D 212F-2134 2139 213C-213F 2145-2149 214E 2183-2184 2C00-2C7B "
    "2C7E-2CE4 2CEB-2CEE 2CF2-2CF3 A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 "
    "FB13-FB17 FF21-FF3A FF41-FF5A 10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2 10CC0-10CF2 118A0-118DF "
    "1E900-1E943"
)
_DEEPSEEK_LLM_LETTERS = r"\s?[" + "".join(
    "-".join(chr(int(end, 16)) for end in span.split("-")) for span in _DEEPSEEK_LLM_CASED.split()) + "]+"
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

_gpt2_like = [_GPT2]
_PRE_TOKENIZERS: dict[str, list[dict[str, Any]]] = {
    **dict.fromkeys(["gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"], _gpt2_like),
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"],
                    [_DIGITS, _GPT2]),
    "falcon": [{"type": "Punctuation", "behavior": "Contiguous"}, _GPT2,
               {"type": "Digits", "individual_digits": False}, _split(r"[0-9][0-9][0-9]")],
    "deepseek-coder": [_split(r"[\r\n]"), _split(r"\s?\p{L}+"), _split(r"\s?\p{P}+"), _split(_CJK), _DIGITS, _BYTES],
    "deepseek-llm": [_split(r"[\r\n]"), _split(_DEEPSEEK_LLM_LETTERS), _split(r"\s?[!-/:-~！-／：-～‘-‟　-。]+"),
                     _split(r"\s+$"), _split(_CJK), _split(r"\p{N}+"), _BYTES],
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense"], [*map(_split, _DEEPSEEK3), _BYTES]),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3", "falcon-h1", "pixtral",
                     "chatglm-bpe", "midm-2.0", "lfm2", "exaone4"], [_split(LLAMA3_REGEX), _BYTES]),
    **dict.fromkeys(["qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan", "megrez", "kormo", "grok-2"],
                    [_split(QWEN2_REGEX), _BYTES]),
    "qwen35": [_split(_QWEN35), _BYTES],
    "tekken": [_split(_TEKKEN), _BYTES],
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], [_split(_GPT4O), _BYTES]),
    **dict.fromkeys(["bloom", "poro-chat", "gpt3-finnish"], [_split(_BLOOM), _BYTES]),
    "viking": [_split(_BLOOM), _DIGITS, _BYTES],
}


def _pre_tokenizer(pre: str | None) -> dict[str, Any]:
    parts = _PRE_TOKENIZERS.get(pre or "")
    if parts is None:
        logger.warning("tokenizer.ggml.pre %r is not known to hearth; splitting text with GPT-2's regex", pre)
        parts = _gpt2_like
    return parts[0] if len(parts) == 1 else {"type": "Sequence", "pretokenizers": parts}


# ---------------------------------------------------------------- GGUF -> tokenizers.Tokenizer

def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: (a, b) for every normal token a+b made of two normal tokens,
    best score of a+b first (ties: lower id of a+b, then the longer left part, as transformers)."""
    ids = {}
    for i, (t, kind) in enumerate(zip(tokens, types)):
        if kind == NORMAL:
            ids.setdefault(t, i)
    found = []
    for piece, i in ids.items():
        score = -scores[i]
        for k in range(1, len(piece)):
            left = piece[:k]
            if left in ids:
                right = piece[k:]
                if right in ids:
                    found.append((score, i, -k, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _split_merge(merge: str) -> tuple[str, str] | None:
    at = merge.find(" ", 1)  # llama.cpp: the first space after the first character
    return (merge[:at], merge[at + 1:]) if at > 0 else None


def _added_token(token_id: int, content: str, special: bool, rstrip: bool = False) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
            "rstrip": rstrip, "normalized": False, "special": special}


def check_gguf_vocab(md: dict[str, Any], tokens: list, types: list) -> None:
    """ModelLoadError unless the vocabulary's arrays have the types and lengths the builder reads."""
    def fail(what: str) -> None:
        raise ModelLoadError(f"GGUF vocabulary: {what}")

    # (the values' exact types, gathered by C loops: ~50k tokens a model, checked at every start)
    if not set(map(type, tokens)) <= {str}:
        fail("tokenizer.ggml.tokens holds values that are not strings")
    if not set(map(type, types)) <= {int}:
        fail("tokenizer.ggml.token_type holds values that are not integers")
    scores = md.get("tokenizer.ggml.scores")
    if scores is not None:
        if not isinstance(scores, list) or len(scores) != len(tokens):
            fail(f"tokenizer.ggml.scores has {len(scores) if isinstance(scores, list) else 'no'} entries "
                 f"for {len(tokens)} tokens")
        if not set(map(type, scores)) <= {int, float}:
            fail("tokenizer.ggml.scores holds values that are not numbers")
    merges = md.get("tokenizer.ggml.merges")
    if merges is not None and not (isinstance(merges, list) and set(map(type, merges)) <= {str}):
        fail("tokenizer.ggml.merges is not a list of strings")


def _gguf_added_tokens(md: dict[str, Any], tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    """Control, unknown and user-defined tokens as the library's added tokens."""
    added = []
    phi3 = md.get("general.architecture") == "phi3" or any(
        n in str(md.get("general.name", "")).lower() for n in ("phi-3", "phi3"))
    for i, (text, t) in enumerate(zip(tokens, types)):
        if t in (CONTROL, UNKNOWN, USER_DEFINED) and text:
            # llama.cpp (from Phi-3's tokenizer.json): its special tokens swallow the whitespace after them
            rstrip = phi3 and text not in ("<unk>", "<s>", "<|endoftext|>")
            added.append(_added_token(i, text, special=t != USER_DEFINED, rstrip=rstrip))
    return added


def _unknown_token(md: dict[str, Any], tokens: list[str]) -> str | None:
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    return tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None


def _llama_model(md: dict[str, Any], tokens: list[str], types: list[int]) -> tuple[dict, dict, None]:
    """SentencePiece BPE: (model, normalizer, pre-tokenizer)."""
    scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)
    model = {"type": "BPE", "dropout": None, "unk_token": _unknown_token(md, tokens), "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
             "vocab": vocab, "merges": _spm_merges(tokens, scores, types)}
    steps = [{"type": "Replace", "pattern": {"String": " "}, "content": SPIECE_SPACE}]
    if md.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, {"type": "Prepend", "prepend": SPIECE_SPACE})
    return model, {"type": "Sequence", "normalizers": steps}, None


def _gemma4_model(md: dict[str, Any], tokens: list[str], types: list[int]) -> tuple[dict, dict, dict]:
    """llama.cpp's gemma4 tokenizer (SentencePiece-style BPE by the file's merges): (model, normalizer,
    pre-tokenizer). Spaces become "▁" (nothing is put before the text); each line and each run of newlines is
    merged apart, a piece that is a token taken whole (llama.cpp's rule for newline runs: the merges may not
    make them), the rest by the merges over its characters; bytes no token holds fall back to <0xNN>."""
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)
    merges = [m for m in map(_split_merge, md.get("tokenizer.ggml.merges") or []) if m]
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True, "ignore_merges": True,
             "vocab": vocab, "merges": merges}
    return model, {"type": "Replace", "pattern": {"String": " "}, "content": SPIECE_SPACE}, _split(r"[^\n]+|\n+")


def _gpt2_model(md: dict[str, Any], tokens: list[str], types: list[int]) -> tuple[dict, None, dict | None]:
    """Byte-level BPE: (model, normalizer, pre-tokenizer)."""
    vocab: dict[str, int] = {}
    for i, (text, t) in enumerate(zip(tokens, types)):
        vocab.setdefault(text, i)
        if t != NORMAL and not all(c in BYTE_OF_CHAR for c in text):
            # an added token stored as plain text ("  "): the library finds its id by this text
            # in the model's vocabulary, and merges may know it in the byte alphabet
            vocab.setdefault(byte_level_spelling(text), i)
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": vocab, "merges": list(md.get("tokenizer.ggml.merges") or [])}  # "a b": split by the library
    return model, None, _pre_tokenizer(md.get("tokenizer.ggml.pre"))


def _bert_model(md: dict[str, Any], tokens: list[str], types: list[int]) -> tuple[dict, dict, dict]:
    """WordPiece: (model, normalizer, pre-tokenizer). llama.cpp writes a word's first piece "▁x" and a
    continuation "x" (WordPiece's "##x")."""
    vocab: dict[str, int] = {}
    for i, (text, t) in enumerate(zip(tokens, types)):
        vocab.setdefault(text if t == CONTROL else text[1:] if text.startswith(SPIECE_SPACE) else "##" + text, i)
    unk = _unknown_token(md, tokens)
    model = {"type": "WordPiece", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
             "unk_token": "[UNK]" if unk is None else unk, "vocab": vocab}
    normalizer = {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                  "strip_accents": None, "lowercase": True}
    return model, normalizer, {"type": "BertPreTokenizer"}


def _from_spec(spec: dict[str, Any], kind: str) -> tokenizers.Tokenizer:
    """The library's tokenizer; gpt2 merges with a space inside a piece, or naming tokens the
    vocabulary lacks, are split and filtered here and the build tried again."""
    try:
        return _build(spec)
    except Exception as first:
        if kind != "gpt2":
            raise ModelLoadError(f"GGUF tokenizer ({kind}) cannot be built: {first}") from None
    model, vocab = spec["model"], spec["model"]["vocab"]
    merges = [m for m in map(_split_merge, model["merges"]) if m]
    usable = [m for m in merges if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    logger.warning("%d of %d merges are malformed or name missing tokens; ignored",
                   len(model["merges"]) - len(usable), len(model["merges"]))
    model["merges"] = usable
    try:
        return _build(spec)
    except Exception as e:
        raise ModelLoadError(f"GGUF tokenizer ({kind}) cannot be built: {e}") from None


def _build(spec: dict[str, Any]) -> tokenizers.Tokenizer:
    """The tokenizer of a tokenizer.json's fields, its model made from the vocabulary and merges directly
    and the added tokens put in after it (as the library's reader does): a real vocabulary's JSON costs
    ~0.1 s to write and read back, a third of a command's start-up before its model loads."""
    model = spec["model"]
    empty = {**model, "vocab": {}} | ({"merges": []} if "merges" in model else {})
    backend = tokenizers.Tokenizer.from_str(json.dumps({**spec, "added_tokens": [], "model": empty}))
    backend.model = _library_model(model)
    backend.add_tokens([tokenizers.AddedToken(a["content"], single_word=a["single_word"], lstrip=a["lstrip"],
                                              rstrip=a["rstrip"], normalized=a["normalized"], special=a["special"])
                        for a in spec["added_tokens"]])
    return backend


def _library_model(model: dict[str, Any]) -> tokenizers.models.Model:
    """The library's BPE or WordPiece of a tokenizer.json's "model" entry. A merge written as one
    string is read by the library's rule: two tokens parted by one space ("#version" lines skipped)."""
    options = {k: v for k, v in model.items() if k not in ("type", "vocab", "merges") and v is not None}
    if model["type"] == "WordPiece":
        return tokenizers.models.WordPiece(model["vocab"], **options)
    merges = model["merges"]  # all pairs (tuples), or all strings (gpt2's, from the file)
    if merges and isinstance(merges[0], str):
        if "\n#version" in "\n" + "\n".join(merges):  # (one search; a newline inside a merge only costs the filter)
            merges = [m for m in merges if not m.startswith("#version")]
        merges = [tuple(m.split(" ")) for m in merges]  # (the split's list kept, then made a tuple: ~0.1 s more)
    if any(len(m) != 2 for m in merges):
        raise ValueError("a merge is not two tokens parted by one space")
    return tokenizers.models.BPE(model["vocab"], merges, **options)


def build_gguf_backend(md: dict[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    kind = md.get("tokenizer.ggml.model")
    added = _gguf_added_tokens(md, tokens, types)
    build = {"llama": _llama_model, "gpt2": _gpt2_model, "gemma4": _gemma4_model}.get(kind, _bert_model)
    model, normalizer, pre_tokenizer = build(md, tokens, types)
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": None,
            "decoder": None, "model": model}
    backend = _from_spec(spec, kind)
    # the library gives an added token the id its text has in the vocabulary: a text that two
    # tokens share ends up on the first of them
    got = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    moved = [a["content"] for a in added if got.get(a["content"]) != a["id"]]
    if moved:
        logger.warning("%d special tokens share their text with an earlier token (e.g. %r); "
                       "the text encodes to the earlier id", len(moved), moved[0])
    return backend
