"""Text <-> token ids: encode, incremental decode, chat templates.

Encoding runs on Hugging Face's `tokenizers` (Rust) library. A Hugging Face folder gives its
tokenizer.json; GGUF metadata (llama.cpp's `tokenizer.ggml.*` keys) is turned into the same kind
of tokenizer here:

- `llama` (SentencePiece BPE): normalizer "▁" prefix + spaces to "▁", a BPE whose merges are
  derived from the vocabulary and scores (a pair (a, b) merges when a+b is a token; the higher
  the score of a+b, the earlier), byte fallback to the `<0xNN>` tokens.
- `gpt2` (byte-level BPE): the file's merges, and the pre-tokenizer splits of the model named by
  `tokenizer.ggml.pre` (llama.cpp's list; the regexes come from each model's tokenizer.json).
- `bert` (WordPiece, lowercasing): for embedding models; text -> ids as HF's BertTokenizer.

Special tokens follow llama.cpp and transformers: control tokens (GGUF type 3, HF special added
tokens) are matched in the text only with `parse_special`; user-defined tokens (type 4, HF
non-special added tokens) are always matched, and are not special.

Decoding is ours, and byte-exact: each id maps to the bytes it stands for, a sequence decodes to
the concatenation (invalid UTF-8 -> U+FFFD), so an `IncrementalDecoder` is a UTF-8 incremental
decoder fed one token's bytes at a time. A tokenizer.json whose decoder is neither byte-level
nor SentencePiece-style falls back to the library's decode, streamed with read/prefix offsets.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
import threading
from pathlib import Path
from typing import Any, Sequence

import tokenizers

from hearth.chat_template import render_chat_template
from hearth.errors import ModelLoadError, RequestError

logger = logging.getLogger(__name__)

# GGUF tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Tokens that end a turn in chat models; llama.cpp treats them as end-of-generation when present.
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
)


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

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
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
                     "chatglm-bpe", "midm-2.0", "lfm2", "exaone4"], [_split(_LLAMA3), _BYTES]),
    **dict.fromkeys(["qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan", "megrez", "kormo", "grok-2"],
                    [_split(_QWEN2), _BYTES]),
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

def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
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
    return [[left, right] for *_, left, right in found]


def _split_merge(merge: str) -> list[str] | None:
    at = merge.find(" ", 1)  # llama.cpp: the first space after the first character
    return [merge[:at], merge[at + 1:]] if at > 0 else None


def _added_token(token_id: int, content: str, special: bool, rstrip: bool = False) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
            "rstrip": rstrip, "normalized": False, "special": special}


def _gguf_backend(md: dict[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    kind = md.get("tokenizer.ggml.model")
    added = []
    phi3 = md.get("general.architecture") == "phi3" or any(
        n in str(md.get("general.name", "")).lower() for n in ("phi-3", "phi3"))
    for i, (text, t) in enumerate(zip(tokens, types)):
        if t in (CONTROL, UNKNOWN, USER_DEFINED) and text:
            # llama.cpp (from Phi-3's tokenizer.json): its special tokens swallow the whitespace after them
            rstrip = phi3 and text not in ("<unk>", "<s>", "<|endoftext|>")
            added.append(_added_token(i, text, special=t != USER_DEFINED, rstrip=rstrip))

    if kind == "llama":
        scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        vocab: dict[str, int] = {}
        for i, text in enumerate(tokens):
            vocab.setdefault(text, i)
        unk_id = md.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
        model = {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                 "vocab": vocab, "merges": _spm_merges(tokens, scores, types)}
        steps = [{"type": "Replace", "pattern": {"String": " "}, "content": SPIECE_SPACE}]
        if md.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, {"type": "Prepend", "prepend": SPIECE_SPACE})
        normalizer, pre_tokenizer = {"type": "Sequence", "normalizers": steps}, None
    elif kind == "gpt2":
        vocab = {}
        for i, (text, t) in enumerate(zip(tokens, types)):
            vocab.setdefault(text, i)
            if t != NORMAL and not all(c in BYTE_OF_CHAR for c in text):
                # an added token stored as plain text ("  "): the library finds its id by this text
                # in the model's vocabulary, and merges may know it in the byte alphabet
                vocab.setdefault(byte_level_spelling(text), i)
        model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                 "vocab": vocab, "merges": list(md.get("tokenizer.ggml.merges") or [])}  # "a b": split by the library
        normalizer, pre_tokenizer = None, _pre_tokenizer(md.get("tokenizer.ggml.pre"))
    else:  # bert: llama.cpp writes a word's first piece "▁x" and a continuation "x" (WordPiece's "##x")
        vocab = {}
        for i, (text, t) in enumerate(zip(tokens, types)):
            vocab.setdefault(text if t == CONTROL else text[1:] if text.startswith(SPIECE_SPACE) else "##" + text, i)
        unk_id = md.get("tokenizer.ggml.unknown_token_id")
        model = {"type": "WordPiece", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
                 "unk_token": tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else "[UNK]",
                 "vocab": vocab}
        normalizer = {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                      "strip_accents": None, "lowercase": True}
        pre_tokenizer = {"type": "BertPreTokenizer"}

    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": None,
            "decoder": None, "model": model}
    try:
        backend = tokenizers.Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    except Exception as first:
        if kind != "gpt2":
            raise ModelLoadError(f"GGUF tokenizer ({kind}) cannot be built: {first}") from None
        # merges with a space inside a piece, or naming tokens the vocabulary lacks: split and filter here
        merges = [m for m in map(_split_merge, model["merges"]) if m]
        usable = [m for m in merges if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
        logger.warning("%d of %d merges are malformed or name missing tokens; ignored",
                       len(model["merges"]) - len(usable), len(model["merges"]))
        model["merges"] = usable
        try:
            backend = tokenizers.Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
        except Exception as e:
            raise ModelLoadError(f"GGUF tokenizer ({kind}) cannot be built: {e}") from None
    # the library gives an added token the id its text has in the vocabulary: a text that two
    # tokens share ends up on the first of them
    got = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    moved = [a["content"] for a in added if got.get(a["content"]) != a["id"]]
    if moved:
        logger.warning("%d special tokens share their text with an earlier token (e.g. %r); "
                       "the text encodes to the earlier id", len(moved), moved[0])
    return backend


def _add_bos_eos(backend: tokenizers.Tokenizer, bos: int | None, eos: int | None) -> None:
    """encode(add_special_tokens=True) puts these around the text."""
    single, special = "$A", []
    if bos is not None:
        single, special = "[BOS] " + single, [("[BOS]", bos)]
    if eos is not None:
        single, special = single + " [EOS]", [*special, ("[EOS]", eos)]
    pair = single.replace("$A", "$A $B:1")
    backend.post_processor = tokenizers.processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


# ---------------------------------------------------------------- tokenizer.json decoders we can do byte-exactly

def _flatten(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [leaf for part in node.get(key) or [] for leaf in _flatten(part, key)]
    return [node]


def _hf_decoding(spec: dict[str, Any]) -> tuple[str, bool] | None:
    """('bytelevel' | 'spm', strip the first space) when the decoder is one we reproduce, else None."""
    parts = _flatten(spec.get("decoder"), "decoders")
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"]:
        return "bytelevel", False
    if kinds == ["Metaspace"]:
        m = parts[0]
        if m.get("replacement", SPIECE_SPACE) != SPIECE_SPACE:
            return None
        scheme = m.get("prepend_scheme") or ("always" if m.get("add_prefix_space", True) else "never")
        return "spm", scheme != "never"
    strip = False
    for p in parts:
        if p.get("type") == "Replace" and (p.get("pattern") or {}).get("String") == SPIECE_SPACE and p.get("content") == " ":
            continue
        if p.get("type") in ("ByteFallback", "Fuse"):
            continue
        if p.get("type") == "Strip" and p is parts[-1] and p.get("content") == " " and p.get("start") == 1 and not p.get("stop"):
            strip = True
            continue
        return None
    return ("spm", strip) if "Replace" in kinds else None


# ---------------------------------------------------------------- the tokenizer

class Tokenizer:
    """Encode text to ids and back; render chat templates. Build with from_hf_dir or from_gguf_metadata."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        pieces: list[str],
        piece_bytes: list[bytes] | None,
        special_ids: set[int],
        bos_token_id: int | None,
        eos_token_ids: list[int],
        strip_first_space: bool,
        chat_template: str | None,
        template_tokens: dict[str, str | None],
    ) -> None:
        self._backend = backend
        self._lock = threading.Lock()  # encode_special_tokens is a setting of the shared backend
        self._pieces = pieces
        self._piece_bytes = piece_bytes  # None: decode through the library
        self._special_ids = frozenset(special_ids)
        self._strip_first_space = strip_first_space
        self._template_tokens = template_tokens
        self.vocab_size = len(pieces)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        probe = backend.encode("", add_special_tokens=True).ids
        self.add_bos = bos_token_id is not None and probe[:1] == [bos_token_id]

    # ------------------------------------------------------------ construction

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> "Tokenizer":
        md = metadata
        kind = md.get("tokenizer.ggml.model")
        if kind not in ("llama", "gpt2", "bert"):
            raise ModelLoadError(
                f"tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; hearth supports "
                "'llama' (SentencePiece BPE), 'gpt2' (byte-level BPE) and 'bert' (WordPiece)"
            )
        tokens = list(md.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens")
        types = list(md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ModelLoadError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        end_of_turn = [i for i, text in enumerate(tokens) if text in END_OF_GENERATION_TEXTS]
        for i in end_of_turn:  # as llama.cpp: these are control tokens, whatever the file says
            if types[i] == NORMAL:
                types[i] = CONTROL
        backend = _gguf_backend(md, tokens, types)

        def token_id(key: str) -> int | None:
            value = md.get(f"tokenizer.ggml.{key}")
            return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        add_bos = md.get("tokenizer.ggml.add_bos_token", kind != "gpt2")  # llama.cpp's defaults
        add_eos = md.get("tokenizer.ggml.add_eos_token", False)
        if kind == "bert":  # [CLS] text [SEP]
            bos, eos = bos if bos is not None else token_id("cls_token_id"), token_id("seperator_token_id")
            add_eos = md.get("tokenizer.ggml.add_sep_token", True)
        _add_bos_eos(backend, bos if add_bos else None, eos if add_eos else None)

        eos_ids = [i for i in (eos, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
        eos_ids += end_of_turn
        if kind == "llama":
            piece_bytes = [spm_bytes(t) if k == BYTE else t.replace(SPIECE_SPACE, " ").encode()
                           for t, k in zip(tokens, types)]
        elif kind == "gpt2":
            piece_bytes = [byte_level_bytes(t) for t in tokens]
        else:  # bert: pieces joined, a space before each word (no clean-up of spaces before punctuation)
            piece_bytes = [t.encode() if k == CONTROL else t.replace(SPIECE_SPACE, " ").encode()
                           for t, k in zip(tokens, types)]
        return cls(
            backend,
            pieces=tokens,
            piece_bytes=piece_bytes,
            special_ids={i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN, UNUSED)},
            bos_token_id=bos,
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            strip_first_space=kind == "bert" or kind == "llama" and md.get("tokenizer.ggml.add_space_prefix", True),
            chat_template=md.get("tokenizer.chat_template"),
            template_tokens={"bos_token": tokens[bos] if bos is not None else None,
                             "eos_token": tokens[eos] if eos is not None else None},
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json (hearth reads Hugging Face fast tokenizers)")
        try:
            text = file.read_text(encoding="utf-8")
            spec = json.loads(text)
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as e:
            raise ModelLoadError(f"{file}: cannot be read ({type(e).__name__}: {e})") from None
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        size = backend.get_vocab_size(with_added_tokens=True)
        pieces = [backend.id_to_token(i) or "" for i in range(size)]
        added = backend.get_added_tokens_decoder()
        special_ids = {i for i, t in added.items() if t.special}

        def configured_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos = configured_id("bos_token")
        eos = configured_id("eos_token")
        for source in (generation, model_config):
            if bos is None and isinstance(source.get("bos_token_id"), int):
                bos = source["bos_token_id"]
        eos_ids = _id_list(generation.get("eos_token_id")) or _id_list(model_config.get("eos_token_id"))
        eos_ids = list(dict.fromkeys([*eos_ids, *([eos] if eos is not None else [])]))

        if "add_bos_token" in config or "add_eos_token" in config:
            # transformers then rebuilds the post-processor from these two (a missing one is False)
            add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
            _add_bos_eos(backend, bos if add_bos else None, eos if add_eos else None)

        decoding = _hf_decoding(spec)
        piece_bytes, strip = None, False
        if decoding is not None:
            kind, strip = decoding
            to_bytes = byte_level_bytes if kind == "bytelevel" else spm_bytes
            piece_bytes = [to_bytes(p) for p in pieces]
            for i, token in added.items():  # added tokens: their text (a byte-level decoder maps it too)
                piece_bytes[i] = to_bytes(token.content)

        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = folder / "chat_template.jinja"
        if not template and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")

        def token_text(name: str) -> str | None:
            token = config.get(name)
            return token.get("content") if isinstance(token, dict) else token

        return cls(
            backend,
            pieces=pieces,
            piece_bytes=piece_bytes,
            special_ids=special_ids,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            strip_first_space=strip,
            chat_template=template or None,
            template_tokens={name: token_text(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")},
        )

    # ------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        with self._lock:
            self._backend.encode_special_tokens = not parse_special  # special tokens' text as plain text
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._piece_bytes is None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        data = b"".join(self._bytes_of(ids, skip_special_tokens))
        if self._strip_first_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def _bytes_of(self, ids: Sequence[int], skip_special_tokens: bool) -> list[bytes]:
        """Each id's bytes; ids past the vocabulary (a model's padded embedding rows) are empty, as in the library."""
        pieces, n = self._piece_bytes, len(self._piece_bytes)
        special = self._special_ids if skip_special_tokens else ()
        return [pieces[i] if 0 <= i < n else b"" for i in ids if i not in special]

    def id_to_piece(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return self._pieces[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def incremental_decoder(self, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> "IncrementalDecoder":
        """Streams decode(ids). With prompt_ids, streams the text the new ids add after the prompt's
        (so a continuation keeps its leading space: decode(prompt + new) minus decode(prompt))."""
        return IncrementalDecoder(self, skip_special_tokens, prompt_ids)

    # ------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        variables = {**{k: v for k, v in self._template_tokens.items() if v is not None}, **kwargs}
        return render_chat_template(self.chat_template, messages, add_generation_prompt, **variables)

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """A conversation's token ids through the chat template: special tokens parsed, BOS added
        when the tokenizer adds one and the template did not."""
        if not messages:
            raise RequestError("messages must contain at least one message")
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true")
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        if continue_final_message:  # end with the final message itself, without its end of turn
            final = messages[-1].get("content") or ""
            if final and final in text:
                text = text[: text.rindex(final) + len(final)]
        ids = self.encode(text, add_special_tokens=False)
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids


class IncrementalDecoder:
    """step(id) returns the text that id completes; all steps + flush() == decode(all ids).

    Byte path: the ids' bytes go through a UTF-8 incremental decoder (O(1) per token; a character
    split over byte tokens comes out with its last byte). Library path (unusual decoders): decode
    a short window [prefix_offset:] and emit what lies past read_offset once it does not end in
    U+FFFD, as vLLM and TGI do.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        if tokenizer._piece_bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            prompt = b"".join(tokenizer._bytes_of(prompt_ids, skip_special_tokens))
            self._utf8.decode(prompt)  # what the prompt leaves unfinished belongs to the new text
            self._strip = tokenizer._strip_first_space and not prompt
        else:
            self._ids = list(prompt_ids)
            self._prefix_offset = self._read_offset = len(self._ids)
            if self._ids:  # keep a little context so leading spaces decode as they do mid-text
                self._prefix_offset = max(0, len(self._ids) - 6)

    def step(self, token_id: int) -> str:
        if self._tok._piece_bytes is None:
            self._ids.append(token_id)
            return self._window(final=False)
        if self._skip and token_id in self._tok._special_ids:
            return ""
        data = self._tok._bytes_of((token_id,), False)[0]
        if self._strip and data:
            self._strip = False
            if data[:1] == b" ":
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        if self._tok._piece_bytes is None:
            return self._window(final=True)
        return self._utf8.decode(b"", final=True)

    def _window(self, final: bool) -> str:
        decode = self._tok.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        text = decode(self._ids[self._prefix_offset:], self._skip)
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        new = text[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    return value if isinstance(value, dict) else {}


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []
