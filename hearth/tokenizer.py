"""Text <-> token ids: encode, incremental decode, chat templates.

Encoding runs on Hugging Face's `tokenizers` (Rust) library. A Hugging Face folder gives its
tokenizer.json; GGUF metadata (llama.cpp's `tokenizer.ggml.*` keys) is turned into the same kind
of tokenizer (hearth/tokenizer_gguf.py):

- `llama` (SentencePiece BPE): normalizer "▁" prefix + spaces to "▁", a BPE whose merges are
  derived from the vocabulary and scores (a pair (a, b) merges when a+b is a token; the higher
  the score of a+b, the earlier), byte fallback to the `<0xNN>` tokens.
- `gemma4` (llama.cpp's gemma4 tokenizer: SentencePiece-style BPE by the file's merges): spaces to "▁",
  nothing prepended, lines and newline runs merged apart, byte fallback to `<0xNN>`, a BOS always.
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
import threading
from pathlib import Path
from typing import Any, Sequence

import tokenizers

from hearth.errors import ModelLoadError, RequestError
from hearth.tokenizer_gguf import (
    BYTE, CONTROL, NORMAL, SPIECE_SPACE, UNKNOWN, UNUSED, build_gguf_backend, byte_level_bytes, check_gguf_vocab,
    spm_bytes,
)

logger = logging.getLogger(__name__)

# Tokens that end a turn in chat models; llama.cpp treats them as end-of-generation when present.
END_OF_GENERATION_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
))


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
        if kind not in ("llama", "gemma4", "gpt2", "bert"):
            raise ModelLoadError(
                f"tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; hearth supports "
                "'llama' and 'gemma4' (SentencePiece BPE), 'gpt2' (byte-level BPE) and 'bert' (WordPiece)"
            )
        tokens = md.get("tokenizer.ggml.tokens") or []
        if not tokens or not isinstance(tokens, list):
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens")
        types = md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if not isinstance(types, list) or len(types) != len(tokens):
            raise ModelLoadError(f"tokenizer.ggml.token_type has {len(types) if isinstance(types, list) else 'no'} "
                                 f"entries for {len(tokens)} tokens")
        check_gguf_vocab(md, tokens, types)
        types = list(types)
        controls = [i for i, text in enumerate(tokens) if text in END_OF_GENERATION_TEXTS]
        for i in controls:  # as llama.cpp: these are control tokens, whatever the file says
            if types[i] == NORMAL:
                types[i] = CONTROL
        # harmony's (gpt-oss): <|end|> ends a message, not the reply (llama.cpp's rule for such vocabularies)
        harmony = {"<|return|>", "<|call|>"} <= {tokens[i] for i in controls}  # (both are among those texts)
        end_of_turn = [i for i in controls if not (harmony and tokens[i] == "<|end|>")]
        backend = build_gguf_backend(md, tokens, types)

        def token_id(key: str) -> int | None:
            value = md.get(f"tokenizer.ggml.{key}")
            return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        add_bos = kind == "gemma4" or md.get("tokenizer.ggml.add_bos_token", kind != "gpt2")  # (llama.cpp's)
        add_eos = md.get("tokenizer.ggml.add_eos_token", False)
        if kind == "bert":  # [CLS] text [SEP]
            bos, eos = bos if bos is not None else token_id("cls_token_id"), token_id("seperator_token_id")
            add_eos = md.get("tokenizer.ggml.add_sep_token", True)
        _add_bos_eos(backend, bos if add_bos else None, eos if add_eos else None)

        eos_ids = [i for i in (eos, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
        eos_ids += end_of_turn
        if kind in ("llama", "gemma4"):
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
        spec, backend = _read_tokenizer_json(folder)
        config = _read_json(folder / "tokenizer_config.json")
        size = backend.get_vocab_size(with_added_tokens=True)
        pieces = [backend.id_to_token(i) or "" for i in range(size)]
        added = backend.get_added_tokens_decoder()
        bos, eos, eos_ids = _hf_bos_eos(backend, config, _read_json(folder / "generation_config.json"),
                                        _read_json(folder / "config.json"))
        if "add_bos_token" in config or "add_eos_token" in config:
            # transformers then rebuilds the post-processor from these two (a missing one is False)
            add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
            _add_bos_eos(backend, bos if add_bos else None, eos if add_eos else None)
        piece_bytes, strip = _hf_piece_bytes(spec, pieces, added)

        def token_text(name: str) -> str | None:
            token = config.get(name)
            return token.get("content") if isinstance(token, dict) else token

        return cls(
            backend,
            pieces=pieces,
            piece_bytes=piece_bytes,
            special_ids={i for i, t in added.items() if t.special},
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            strip_first_space=strip,
            chat_template=_hf_chat_template(folder, config),
            template_tokens={name: token_text(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")},
        )

    # ------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        with self._lock:
            self._backend.encode_special_tokens = not parse_special  # special tokens' text as plain text
            # encode_batch lets go of the GIL while it works (encode does not): a long prompt
            # tokenized on a server's worker thread then leaves its event loop free
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

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

    @property
    def special_token_texts(self) -> dict[str, str | None]:
        """The text of bos_token, eos_token, unk_token, pad_token (None where the model has none)."""
        return dict(self._template_tokens)

    def token_bytes(self) -> list[bytes]:
        """Every id's bytes, special tokens as their text (what a grammar engine matches tokens by)."""
        if self._piece_bytes is None:
            return [self._backend.decode([i], skip_special_tokens=False).encode() for i in range(self.vocab_size)]
        return list(self._piece_bytes)

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """The conversation's prompt text; `chat_template`: a template to use instead of the model's."""
        from hearth.chat_template import render_chat_template  # Jinja: paid for by chats only

        variables = {**{k: v for k, v in self._template_tokens.items() if v is not None}, **kwargs}
        return render_chat_template(chat_template or self.chat_template, messages, add_generation_prompt, **variables)

    def chat_text(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """A conversation's prompt text through the chat template; with continue_final_message it ends
        with the final message itself (its last text part, where its content is a list of parts), without
        its end of turn."""
        if not messages:
            raise RequestError("messages must contain at least one message")
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true")
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template, **kwargs)
        if continue_final_message:
            final = messages[-1].get("content") or ""
            if isinstance(final, list):
                final = next((p.get("text") or "" for p in reversed(final) if p.get("type") == "text"), "")
            if final and final in text:
                text = text[: text.rindex(final) + len(final)]
        return text

    def encode_chat_text(self, text: str) -> list[int]:
        """A rendered conversation's token ids: special tokens parsed, BOS added when the tokenizer adds
        one and the template did not."""
        ids = self.encode(text, add_special_tokens=False)
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def chat_prompt_text(self, text: str) -> str:
        """A rendered conversation as encode() takes it (a text prompt with images is encoded so): the BOS
        the template wrote left out where encode adds one, so that it comes once."""
        bos = self._template_tokens.get("bos_token")
        return text[len(bos):] if self.add_bos and bos and text.startswith(bos) else text

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """A conversation's token ids through the chat template (chat_text, then encode_chat_text)."""
        return self.encode_chat_text(
            self.chat_text(messages, add_generation_prompt, continue_final_message, chat_template, **kwargs))


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


def _read_tokenizer_json(folder: Path) -> tuple[dict[str, Any], tokenizers.Tokenizer]:
    """tokenizer.json as a dict and as the library's tokenizer."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json (hearth reads Hugging Face fast tokenizers)")
    try:
        text = file.read_text(encoding="utf-8")
        return json.loads(text), tokenizers.Tokenizer.from_str(text)
    except Exception as e:
        raise ModelLoadError(f"{file}: cannot be read ({type(e).__name__}: {e})") from None


def _hf_bos_eos(backend: tokenizers.Tokenizer, config: dict[str, Any], generation: dict[str, Any],
                model_config: dict[str, Any]) -> tuple[int | None, int | None, list[int]]:
    """(bos, the tokenizer's eos, every id that ends generation): tokenizer_config's tokens, then
    generation_config's and config.json's ids."""
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
    return bos, eos, list(dict.fromkeys([*eos_ids, *([eos] if eos is not None else [])]))


def _hf_piece_bytes(spec: dict[str, Any], pieces: list[str],
                    added: dict[int, tokenizers.AddedToken]) -> tuple[list[bytes] | None, bool]:
    """Each token's bytes where the decoder is one hearth knows (byte-level or SentencePiece), and whether
    a text's first space is stripped; (None, False) otherwise (the library decodes)."""
    decoding = _hf_decoding(spec)
    if decoding is None:
        return None, False
    kind, strip = decoding
    to_bytes = byte_level_bytes if kind == "bytelevel" else spm_bytes
    piece_bytes = [to_bytes(p) for p in pieces]
    for i, token in added.items():  # added tokens: their text (a byte-level decoder maps it too)
        piece_bytes[i] = to_bytes(token.content)
    return piece_bytes, strip


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """tokenizer_config's template (the default of a named list), else chat_template.jinja."""
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja = folder / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template or None


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
