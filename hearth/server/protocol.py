"""The HTTP API's shapes: request bodies (OpenAI's fields plus vLLM's extra sampling fields)
and the pieces of responses built from RequestOutputs (usage, logprobs).

Unknown fields are ignored (as vLLM does), wrong types fail validation (the app answers
400 in OpenAI's error JSON), and the ranges are checked by SamplingParams itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hearth.errors import RequestError
from hearth.outputs import PositionLogprobs, RequestOutput
from hearth.sampling_params import SamplingParams
from hearth.server.structured import StructuredOutputFields
from hearth.server.tools import template_tool_call

MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs (and vLLM's default max_logprobs)
MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM's stand-in)
PREFILL_HEADER = "x-hearth-prefill-url"  # the prefill worker a decode worker pulls a prompt's KV from: URL or ray://


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class WatermarkRequest(OpenAIModel):
    """hearth's own field: a green-list watermark on the output (hearth/watermark.py)."""

    key: int
    delta: float = 2.0
    gamma: float = 0.25


class _SamplingRequest(StructuredOutputFields, OpenAIModel):
    """The fields both generation routes share."""

    model: str | None = None
    n: int | None = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True  # accepted; decoding is byte-exact either way
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM: keep only the last N prompt tokens
    use_beam_search: bool | None = False
    watermark: WatermarkRequest | None = None
    speculative: bool | None = True  # hearth's: false opts this request out of speculative decoding
    contrastive_weight: float | None = None  # hearth's: contrastive decoding against --contrastive-model
    contrastive_alpha: float | None = None
    priority: int = Field(0, ge=-(2**63), lt=2**63)  # vLLM's: a lower value is served first
    thinking_token_budget: int | None = None  # vLLM's: thinking closed after this many tokens (--reasoning-parser)
    penalty_alpha: float | None = None  # transformers' contrastive search (Su et al. 2022), with top_k
    calm_threshold: float | None = None  # hearth's: CALM early exit when this confident (hearth/model/calm.py)
    calm_measure: str | None = None  # hearth's: CALM's confidence measure (softmax, saturation, saturation-softmax)
    calm_saturation_bound: float | None = None  # hearth's: saturation-softmax's loose bound
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """SamplingParams of this request; RequestError (400) for values out of range."""
        if self.use_beam_search:
            raise RequestError("use_beam_search is not supported by this server")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.")
        if self.stream and self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError("best_of different from n is not supported with stream=true")
        body = self.model_dump(include=set(SamplingParams.__dataclass_fields__))
        return SamplingParams.from_openai(body, max_tokens=max_tokens, logprobs=logprobs,
                                          prompt_logprobs=prompt_logprobs,
                                          structured_outputs=self.structured_outputs_params())

    def truncate(self, ids: list[int]) -> list[int]:
        return ids if self.truncate_prompt_tokens is None else ids[-self.truncate_prompt_tokens:]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = True  # vLLM: BOS before a text prompt when the model wants one

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or a list of token ids."""
        if self.suffix:
            raise RequestError("suffix is not supported by this server")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIModel):
    url: str  # a data URL, or http(s) (hearth/server/images.py)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the size


class ImageURLPart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURLPart(OpenAIModel):  # vLLM's extension (Qwen3-VL's and Qwen3.5's videos)
    type: Literal["video_url"]
    video_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


def chat_content(parts: list[tuple[str, str]], joiner: str = "\n") -> str | list[dict[str, str | dict]]:
    """Another API's content as chat completions' (its parts as ("text", text) or ("image", url), in
    order): the text joined by `joiner` where there is no image, else a list of text and image_url parts."""
    if all(kind == "text" for kind, _ in parts):
        return joiner.join(text for _, text in parts)
    return [{"type": "text", "text": value} if kind == "text" else {"type": "image_url", "image_url": {"url": value}}
            for kind, value in parts]


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def image_urls(self) -> list[str]:
        parts = self.content if isinstance(self.content, list) else []
        return [p.image_url.url for p in parts if isinstance(p, ImageURLPart)]

    def video_urls(self) -> list[str]:
        parts = self.content if isinstance(self.content, list) else []
        return [p.video_url.url for p in parts if isinstance(p, VideoURLPart)]

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined; with images, a list of parts in
        their order, each image an `{"type": "image"}` part (transformers' convention, which vision
        models' templates render as their image marker), each video a `{"type": "video"}` part."""
        content = self.content
        if isinstance(content, list) and (self.image_urls() or self.video_urls()):
            content = [{"type": "text", "text": p.text} if isinstance(p, TextPart)
                       else {"type": "video" if isinstance(p, VideoURLPart) else "image"} for p in content]
        elif isinstance(content, list):
            content = "\n".join(part.text for part in content)
        # "" for none (an assistant's turn of tool calls): templates such as Qwen 3's concatenate it
        message: dict[str, Any] = {"role": self.role, "content": "" if content is None else content}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls is not None:
            message["tool_calls"] = [template_tool_call(call) for call in self.tool_calls]
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # checked by hearth/server/tools.py
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False  # the template already wrote the special tokens
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: this request's own template (--trust-request-chat-template)
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: the image processor's settings for its images

    def conversation(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise RequestError("messages must contain at least one message")
        return [m.for_template() for m in self.messages]

    def image_urls(self) -> list[str]:
        """The images' URLs in the order the conversation gives them (the order of its image parts)."""
        return [url for m in self.messages for url in m.image_urls()]

    def video_urls(self) -> list[str]:
        """The videos' URLs in the order the conversation gives them."""
        return [url for m in self.messages for url in m.video_urls()]

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise RequestError(f"top_logprobs must be non-negative, got {self.top_logprobs}.")
        if not self.logprobs:
            if self.top_logprobs:
                raise RequestError("top_logprobs requires logprobs=true")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a `prompt`, or chat `messages` through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int] = Field(...)


# ---- pieces of responses; `piece` is a token id's text


def usage(outputs: list[RequestOutput | None]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def hearth_fields(outputs: list[RequestOutput | None]) -> dict:
    """hearth's own extension of a response: {"hearth": {"cascade": [each prompt's record]}} where a cascade
    (--cascade) served it (hearth/engine/cascade.py), else nothing."""
    records = [o.cascade.summary(max((len(c.token_ids) for c in o.outputs), default=0))
               for o in outputs if o is not None and o.cascade is not None]
    return {"hearth": {"cascade": records}} if records else {}


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def completion_logprobs(piece: Callable[[int], str], ids: list[int], entries: list[PositionLogprobs | None],
                        offset: int) -> dict[str, list]:
    """OpenAI's legacy logprobs object (tokens, token_logprobs, top_logprobs, text_offset);
    `offset` is where the first token's text starts. An entry of None (the prompt's first token) gives None."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(ids, entries):
        text = piece(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(entry.get(token_id, -math.inf)))
        top = sorted(entry.items(), key=lambda kv: -kv[1])
        out["top_logprobs"].append({piece(t): _lp(lp) for t, lp in top})
    return out


def chat_logprobs(piece: Callable[[int], str], ids: list[int], entries: list[PositionLogprobs], k: int) -> list[dict]:
    """The `content` list of a chat choice's logprobs: each token with its k best alternatives."""
    content = []
    for token_id, entry in zip(ids, entries):
        text = piece(token_id)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        content.append({
            "token": text, "logprob": _lp(entry.get(token_id, -math.inf)), "bytes": list(text.encode()),
            "top_logprobs": [{"token": piece(t), "logprob": _lp(lp), "bytes": list(piece(t).encode())} for t, lp in top],
        })
    return content


def prompt_logprobs_json(piece: Callable[[int], str], output: RequestOutput) -> list | None:
    """vLLM's prompt_logprobs: per prompt position {token_id: {logprob, decoded_token}}, None first."""
    if output.prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): {"logprob": _lp(lp), "decoded_token": piece(t)} for t, lp in e.items()}
            for e in output.prompt_logprobs]
