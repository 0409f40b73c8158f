"""How a request wants its tokens chosen: SamplingParams (vLLM's fields) and BeamSearchParams.

Field names, defaults and meanings follow vLLM's `SamplingParams`, so code written for
vLLM reads the same here. Every check raises `RequestError` (a `ValueError`) whose
message names the field and the allowed range; the server turns it into a 400.
"""

from __future__ import annotations

import enum
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hearth.config import MAX_DECODE_QUERY_LEN
from hearth.errors import HearthError, RequestError

logger = logging.getLogger(__name__)

# Below this a temperature means greedy decoding (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Positive temperatures below this are raised to it: dividing logits by a tiny number
# overflows float32 (vLLM's _MAX_TEMP, with the same warning).
MIN_TEMPERATURE = 1e-2
# Contrastive search's most candidates (top_k): they run as rows of one sequence through the decode kernels.
MAX_CONTRASTIVE_CANDIDATES = MAX_DECODE_QUERY_LEN
# OpenAI's range for one logit_bias value.
MAX_ABS_LOGIT_BIAS = 100.0
# CALM's confidence measures (hearth/model/calm.py): the softmax response, hidden-state saturation, and
# the softmax response computed only where the saturation reaches a loose bound
CALM_MEASURES = ("softmax", "saturation", "saturation-softmax")


class SamplingType(enum.IntEnum):
    GREEDY = 0  # argmax of the (penalized, biased) logits
    RANDOM = 1  # a draw from the shared global RNG
    RANDOM_SEED = 2  # a draw from the request's own torch.Generator, seeded with `seed`


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RequestError(message)


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise HearthError(f"{path}: cannot read: {e.strerror}") from None


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's StructuredOutputsParams); give exactly one of
    json, regex, choice, grammar, json_object.

    `grammar` is a context-free grammar in Lark's syntax (llguidance's dialect) or in
    llama.cpp's GBNF (`root ::= ...`); the JSON kinds allow a newline and up to 20 spaces or
    tabs between tokens (llama.cpp's bound) unless disable_any_whitespace asks for none.
    """

    json: str | dict[str, Any] | None = None  # a JSON schema, or its text
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        _check(len(given) == 1, "structured output needs exactly one of json, regex, choice, grammar, json_object; "
                                f"got {', '.join(given) or 'none'}.")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise RequestError(f"the JSON schema is not valid JSON: {e}") from None
        if self.json is not None:
            _check(isinstance(self.json, (dict, bool)), "a JSON schema must be an object.")
        if self.choice is not None:
            _check(isinstance(self.choice, list) and bool(self.choice) and all(isinstance(c, str) for c in self.choice),
                   "choice must be a non-empty list of strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and bool(value.strip())), f"{name} must be a non-empty string.")

    @classmethod
    def from_cli(cls, args: Any) -> StructuredOutputsParams | None:
        """From `hearth generate/chat`'s --json-schema FILE, --regex or --grammar FILE (None without them)."""
        if args.json_schema is not None:
            return cls(json=_read_text(args.json_schema))
        if args.regex is not None:
            return cls(regex=args.regex)
        if args.grammar is not None:
            return cls(grammar=_read_text(args.grammar))
        return None

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """Equal for specs that compile to the same grammar."""
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace], sort_keys=True)


@dataclass
class WatermarkParams:
    """Watermark a request's output: green tokens (a fraction gamma) get +delta on their logits."""

    key: int  # the secret: the same key detects it
    delta: float = 2.0
    gamma: float = 0.25

    def __post_init__(self) -> None:
        _check(isinstance(self.key, int) and 0 <= self.key < 2**32,
               f"watermark key must be an integer in [0, 2**32), got {self.key!r}.")
        _check(math.isfinite(self.delta) and self.delta >= 0, f"watermark delta must be a finite number >= 0, got {self.delta}.")
        _check(0 < self.gamma < 1, f"watermark gamma must be in (0, 1), got {self.gamma}.")


@dataclass
class SamplingParams:
    """Sampling parameters of one request, with vLLM's names, defaults and meanings.

    Disabled values: top_k 0 or -1, top_p 1.0, min_p 0.0, the penalties 0.0 / 1.0.
    After construction `stop` and `stop_token_ids` are lists, `logit_bias` has int keys,
    and a greedy request (temperature 0) has top_p/top_k/min_p reset to their no-op values.
    """

    n: int = 1  # outputs returned per prompt
    best_of: int | None = None  # sequences generated, the n best returned (>= n)
    presence_penalty: float = 0.0  # [-2, 2]; logit -= presence * (count > 0), output tokens only
    frequency_penalty: float = 0.0  # [-2, 2]; logit -= frequency * count, output tokens only
    repetition_penalty: float = 1.0  # > 0; HF's: prompt+output tokens, logit>0 -> /p else *p
    temperature: float = 1.0  # >= 0; 0 means greedy
    top_p: float = 1.0  # (0, 1]; 1 keeps all tokens
    top_k: int = 0  # 0 or -1 keep all tokens, else >= 1
    min_p: float = 0.0  # [0, 1]; drop tokens with p < min_p * p_max
    seed: int | None = None  # a per-request generator: same seed, same tokens, whatever the batch
    stop: str | list[str] | None = None  # strings that end generation (not in the output text)
    stop_token_ids: list[int] | None = None  # token ids that end generation
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # 0 allowed (prompt scoring: echo + prompt_logprobs); None: up to the context
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    logprobs: int | None = None  # top alternatives per output token (-1: the whole vocabulary)
    prompt_logprobs: int | None = None  # top alternatives per prompt token (-1: the whole vocabulary)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, each in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None  # the output follows a schema or grammar
    watermark: WatermarkParams | None = None  # green-list watermark (hearth/watermark.py)
    speculative: bool = True  # hearth's: False opts this request out of the engine's speculative decoding
    # contrastive decoding (Li et al. 2023) against the engine's contrastive_model (the amateur):
    # scores log p_expert - weight * log p_amateur over the tokens with p_expert >= alpha * max p_expert
    contrastive_weight: float = 0.0  # >= 0; 0: off
    contrastive_alpha: float = 0.1  # [0, 1]: the plausibility cut-off
    # vLLM's: after this many tokens of thinking the engine closes the section (hearth/engine/thinking.py);
    # None: the engine's reasoning_budget; -1: no limit
    thinking_token_budget: int | None = None
    # contrastive search (Su et al. 2022; transformers' penalty_alpha): among the top_k tokens by
    # probability, the one of most (1 - alpha) p(v) - alpha max_j cos(h_v, h_j) over the hidden states
    # of the tokens before; deterministic (temperature, top_p, min_p and seed play no part)
    penalty_alpha: float = 0.0  # [0, 1]; 0: off; > 0 needs top_k in [2, 16]
    # CALM early exit (Schuster et al. 2022; hearth/model/calm.py), lossy by choice: a decode token leaves
    # the model at the first of the engine's calm_exit_layers where its confidence (calm_measure) reaches
    # this; None: off (every layer runs); 1: never leaves
    calm_threshold: float | None = None  # [0, 1]
    # "softmax": the intermediate prediction's top-1 minus top-2 probability (an LM head pass per check);
    # "saturation": the cosine of the hidden states after the exit layer and the layer before (no LM head);
    # "saturation-softmax": the softmax response, computed only where the saturation reaches calm_saturation_bound
    calm_measure: str = "softmax"
    calm_saturation_bound: float = 0.9  # [-1, 1]

    @classmethod
    def from_openai(cls, body: Mapping[str, Any], **given: Any) -> SamplingParams:
        """From an OpenAI-style request body (vLLM's extra fields and hearth's included): each field the
        body has under a SamplingParams name, null meaning the default; `given` (what the route works
        out itself: max_tokens, logprobs, prompt_logprobs, structured_outputs) wins over the body."""
        values = {f.name: body[f.name] for f in fields(cls) if body.get(f.name) is not None}
        if isinstance(values.get("watermark"), Mapping):
            values["watermark"] = WatermarkParams(**values["watermark"])
        return cls(**(values | given))

    @classmethod
    def from_cli(cls, args: Any) -> SamplingParams:
        """From `hearth generate/chat`'s sampling flags: those named after a field (--max-tokens,
        --temperature, --top-p, --seed, --stop, ...), the structured-output ones and --watermark-key/-delta."""
        flags = vars(args)
        values = {f.name: flags[f.name] for f in fields(cls) if f.name in flags}
        watermark = None if args.watermark_key is None else WatermarkParams(args.watermark_key, args.watermark_delta)
        return cls(**values, structured_outputs=StructuredOutputsParams.from_cli(args), watermark=watermark)

    def __post_init__(self) -> None:
        if self.seed == -1:  # vLLM: -1 means "no seed"
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.logit_bias is not None:
            self.logit_bias = self._int_keys(self.logit_bias)
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s, which overflows the logits; using %s",
                self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE
        self._verify()
        if self.temperature < SAMPLING_EPS and not self.contrastive_search:  # greedy: the filters change nothing
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @staticmethod
    def _int_keys(bias: dict) -> dict[int, float]:
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                raise RequestError(f"logit_bias keys must be integer token ids, got {key!r}") from None
            out[token_id] = float(value)
        return out

    def _verify(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}.")
        if self.best_of is not None:
            _check(
                isinstance(self.best_of, int) and self.best_of >= self.n,
                f"best_of must be greater than or equal to n={self.n}, got {self.best_of}.",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}.")
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            f"repetition_penalty must be a finite number greater than zero, got {self.repetition_penalty}.",
        )
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            f"temperature must be a finite number >= 0, got {self.temperature}.",
        )
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        _check(isinstance(self.top_k, int), f"top_k must be an integer, got {type(self.top_k).__name__}.")
        _check(self.top_k >= -1, f"top_k must be 0 (disable), -1 (disable) or at least 1, got {self.top_k}.")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        _check(isinstance(self.speculative, bool), f"speculative must be true or false, got {self.speculative!r}.")
        _check(math.isfinite(self.contrastive_weight) and self.contrastive_weight >= 0.0,
               f"contrastive_weight must be a finite number >= 0, got {self.contrastive_weight}.")
        _check(0.0 <= self.contrastive_alpha <= 1.0, f"contrastive_alpha must be in [0, 1], got {self.contrastive_alpha}.")
        _check(self.thinking_token_budget is None or (isinstance(self.thinking_token_budget, int)
                                                      and self.thinking_token_budget >= -1),
               f"thinking_token_budget must be -1 (no limit) or at least 0, got {self.thinking_token_budget!r}.")
        self._verify_contrastive_search()
        self._verify_calm()
        if self.max_tokens is not None:
            _check(self.max_tokens >= 0, f"max_tokens must be at least 0, got {self.max_tokens}.")
        _check(self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(value >= -1, f"{name} must be non-negative or -1 (whole vocabulary), got {value}.")
        _check(
            all(isinstance(t, int) for t in self.stop_token_ids),
            f"stop_token_ids must contain only integers, got {self.stop_token_ids}.",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop cannot contain an empty string.")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(
                math.isfinite(bias) and -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS,
                f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}.",
            )
        if self.temperature < SAMPLING_EPS:
            _check(self.n == 1, f"n must be 1 when using greedy sampling, got {self.n}.")

    def _verify_calm(self) -> None:
        _check(self.calm_threshold is None or (isinstance(self.calm_threshold, (int, float))
                                               and 0.0 <= self.calm_threshold <= 1.0),
               f"calm_threshold must be a number in [0, 1] (or null: off), got {self.calm_threshold!r}.")
        _check(self.calm_measure in CALM_MEASURES,
               f"calm_measure must be one of {', '.join(CALM_MEASURES)}, got {self.calm_measure!r}.")
        _check(isinstance(self.calm_saturation_bound, (int, float)) and -1.0 <= self.calm_saturation_bound <= 1.0,
               f"calm_saturation_bound must be a number in [-1, 1], got {self.calm_saturation_bound!r}.")
        _check(self.calm_threshold is None or not self.contrastive_search,
               "calm_threshold (early exit) does not go with contrastive search (penalty_alpha > 0).")

    def _verify_contrastive_search(self) -> None:
        _check(math.isfinite(self.penalty_alpha) and 0.0 <= self.penalty_alpha <= 1.0,
               f"penalty_alpha must be in [0, 1], got {self.penalty_alpha}.")
        if not self.contrastive_search:
            return
        _check(2 <= self.top_k <= MAX_CONTRASTIVE_CANDIDATES,
               f"contrastive search (penalty_alpha > 0) needs top_k in [2, {MAX_CONTRASTIVE_CANDIDATES}], got {self.top_k}.")
        _check(self.n == 1 and (self.best_of or 1) == 1,
               "contrastive search (penalty_alpha > 0) is deterministic: n and best_of must be 1.")
        _check(self.structured_outputs is None and self.contrastive_weight == 0,
               "contrastive search (penalty_alpha > 0) does not go with structured outputs or contrastive_weight.")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise RequestError for token ids (logit_bias, stop_token_ids) or a top_k outside the vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias or {})), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            _check(not bad, f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad}.")
        _check(
            self.top_k <= vocab_size,
            f"top_k cannot be greater than the vocabulary size ({vocab_size}), got {self.top_k}.",
        )

    @property
    def contrastive_search(self) -> bool:
        return self.penalty_alpha > 0

    @property
    def reads_earlier_tokens(self) -> bool:
        """Whether the next token's draw reads the tokens drawn before it on the host: penalties (the
        output so far), the watermark (the last token's green list), contrastive decoding and search
        (a second model's or the candidates' pass after the last token)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.watermark is not None or self.contrastive_weight > 0 or self.contrastive_search)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS or self.contrastive_search:  # contrastive search draws nothing
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


@dataclass
class BeamSearchParams:
    """Beam search (vLLM's BeamSearchParams): keep the `beam_width` best sequences by
    cumulative log-probability divided by length ** length_penalty."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check(
            isinstance(self.beam_width, int) and self.beam_width >= 1,
            f"beam_width must be at least 1, got {self.beam_width}.",
        )
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be at least 1, got {self.max_tokens}.",
        )
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            f"temperature must be a finite number >= 0, got {self.temperature}.",
        )
        _check(math.isfinite(self.length_penalty), f"length_penalty must be a finite number, got {self.length_penalty}.")
