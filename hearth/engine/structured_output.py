"""Structured output: grammars compiled by llguidance, a matcher per sequence, token masks per step.

    compiler = GrammarCompiler(tokenizer, vocab_size)
    grammar = compiler.compile(params.structured_outputs)   # RequestError naming the problem
    matcher = compiler.matcher(grammar)                      # one per sequence
    pending = compiler.start_masks([matcher, ...], new_bitmask=GrammarBitmask)  # filled off-thread
    ...                                                      # (the sampler draws its noise meanwhile)
    bitmask = pending.result()                               # [R, ceil(V/32)] int32, bit t: token t allowed
    done = advance(matcher, token_id)                        # True: the grammar is complete

llguidance (rather than xgrammar) because it has no dependencies (xgrammar pulls torch-related
packages), takes Lark grammars and llama.cpp's GBNF as they are, and computes a mask lazily
from a token trie (tens of microseconds a token) without a compile step per schema: a
request's grammar costs about a millisecond before its first token.

The masks' tensor is the sampler's (sampler.GrammarBitmask, handed in by the runner): this module
keeps the matchers and says which rows they fill, and builds no tensors.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance

from hearth.errors import RequestError
from hearth.sampling_params import StructuredOutputsParams
from hearth.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from hearth.engine.sampler import GrammarBitmask

logger = logging.getLogger("hearth")

# llama.cpp's bound on whitespace in JSON: a space, or a newline and an indentation of up to 20
JSON_WHITESPACE = r"[ ]?|\n[ \t]{0,20}"
# llguidance's worker threads for a batch's masks: a few are plenty (a mask is tens of microseconds),
# and more would take cores from the sampler's work running at the same time
MASK_THREADS = max(1, min(4, (os.cpu_count() or 2) // 4))
CACHE_SIZE = 256  # compiled grammars kept (a server sees the same few schemas again and again)

_DESCRIPTIONS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
                 "grammar": "grammar"}


class _TokenizerView:
    """hearth's tokenizer as llguidance.TokenizerWrapper reads one: token bytes, EOS, specials, encode."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        pieces = tokenizer.token_bytes()
        # rows of the model's output past the tokenizer's vocabulary: empty tokens, never allowed
        self.tokens = pieces + [b""] * max(0, vocab_size - len(pieces))
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i in range(len(pieces)) if tokenizer.is_special(i)]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False,
                                      parse_special=False)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; thread-safe (the server compiles off the
    engine thread, the engine then finds the grammar in the cache)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None  # built on first use
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self._mask_thread: ThreadPoolExecutor | None = None

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                view = _TokenizerView(self.tokenizer, self.vocab_size)
                self._lltokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(view), eos_token=self.tokenizer.eos_token_ids or None)
            return self._lltokenizer

    def compile(self, spec: StructuredOutputsParams) -> str:
        """llguidance's grammar for `spec`, checked; RequestError says what is wrong with it."""
        key = spec.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._grammar(spec)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if problem:
            raise RequestError(f"the {_DESCRIPTIONS[spec.kind]} cannot be compiled: {_one_line(problem)}")
        with self._lock:
            self._cache[key] = grammar
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    @staticmethod
    def _grammar(spec: StructuredOutputsParams) -> str:
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else spec.json
                options = {"whitespace_flexible": False} if spec.disable_any_whitespace else \
                    {"whitespace_pattern": JSON_WHITESPACE}
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
            if kind == "choice":
                return llguidance.grammar_from("choice", spec.choice)
            return llguidance.grammar_from(kind, getattr(spec, kind))  # "regex", or "grammar": Lark or GBNF
        except ValueError as e:
            raise RequestError(f"the {_DESCRIPTIONS[kind]} cannot be compiled: {e}") from None

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start (one per sequence)."""
        return llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)

    def start_masks(self, matchers: list[llguidance.LLMatcher], guesses: list[list[int]] | None = None, *,
                    new_bitmask: Callable[[int, int], GrammarBitmask]) -> Future[torch.Tensor]:
        """Fill the matchers' next-token masks, in a new_bitmask(rows, vocab_size), on a background
        thread: llguidance releases the GIL, so the engine goes on meanwhile (the sampler draws its
        noise); the future holds the filled bitmask's tensor. With speculative guesses, matcher i
        gets len(guesses[i]) + 1 consecutive rows: the mask at each verified position, as if the
        guesses before it were taken (the matcher is rolled back afterwards). A position after a
        guess the grammar refuses repeats the last mask: that guess is rejected anyway."""
        with self._lock:
            if self._mask_thread is None:
                self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
                self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="hearth-grammar")
        guesses = guesses or [[] for _ in matchers]
        first_rows = [0]
        for g in guesses:
            first_rows.append(first_rows[-1] + len(g) + 1)
        num_rows = first_rows[-1]
        bitmask = new_bitmask(num_rows, self.vocab_size)

        def fill() -> torch.Tensor:
            taken = [0] * len(matchers)  # guesses each matcher has consumed
            for depth in range(max(len(g) for g in guesses) + 1):
                live = [i for i, g in enumerate(guesses) if taken[i] == depth]
                if not live:
                    break
                rows = [(matchers[i], first_rows[i] + depth) for i in live]
                self._executor.unsafe_compute_mask_ptr(rows, bitmask.address, bitmask.row_bytes, num_rows)
                for i in live:
                    if depth < len(guesses[i]) and matchers[i].try_consume_tokens([guesses[i][depth]]) == 1:
                        taken[i] += 1
            for i, matcher in enumerate(matchers):
                if taken[i]:
                    matcher.rollback(taken[i])
                last = first_rows[i] + taken[i]
                if last + 1 < first_rows[i + 1]:  # a refused guess: its later rows repeat its mask
                    bitmask.repeat_row(last, first_rows[i + 1])
            return bitmask.tensor

        return self._mask_thread.submit(fill)


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpt and caret lines (errors are one line)."""
    lines = [line.strip() for line in message.splitlines()]
    return " ".join(line for line in lines if line and not set(line) <= {"^", " "} and not re.match(r"\d+ \|", line))


def advance(matcher: llguidance.LLMatcher, token_id: int) -> bool:
    """Feed the sampled token; True when the grammar is complete (nothing but EOS may follow).

    The mask allowed only tokens the grammar accepts, so a refusal is a bug: it is logged and
    the request ends, rather than go on unconstrained."""
    if not matcher.consume_token(token_id):
        logger.error("grammar refused token %d: %s", token_id, matcher.get_error())
        return True
    return matcher.is_stopped()
