"""POST /v1/chat/completions: the conversation through the chat template, one engine request."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from PIL import Image

from hearth.engine.async_engine import RequestStream
from hearth.engine.images import PromptWithImages
from hearth.outputs import CompletionOutput, RequestOutput
from hearth.reasoning import ReasoningSplit
from hearth.server.errors import APIError
from hearth.server.protocol import ChatCompletionRequest, chat_logprobs, hearth_fields, prompt_logprobs_json, usage
from hearth.server.served import ServedModel, served
from hearth.server.streaming import Delta, Started, StreamHeader, respond
from hearth.server.tool_fallback import generic_calling, generic_messages, template_drops_tools
from hearth.server.tools import ToolCalling, ToolCallStream, tool_calling
from hearth.videos import VideoFrames

router = APIRouter()


class ChatFormat:
    """A chat choice streams as OpenAI's: a role delta first, then content deltas (and, with tool
    calling, the deltas of its tool calls; with a reasoning parser, reasoning_content deltas)."""

    object = "chat.completion.chunk"

    def __init__(self, served: ServedModel, k: int | None, calling: ToolCalling | None = None,
                 thinking: bool = False) -> None:
        self.served, self.k, self.calling = served, k, calling
        self.reasoning, self.thinking = served.reasoning, thinking  # thinking: the prompt opened the section
        self.tool_streams: dict[int, ToolCallStream] = {}  # per choice index
        self.splits: dict[int, ReasoningSplit] = {}  # per choice index, with a reasoning parser

    def message_delta(self, d: Delta) -> dict:
        c, delta, text = d.choice, {}, d.text
        final = c.finish_reason is not None
        if self.reasoning is not None:
            split = self.splits.setdefault(c.index, self.reasoning.parser(self.thinking))
            reasoning, text = split.update(c.text, final)  # (a delta that sent nothing comes again in the next)
            delta = {"reasoning_content": reasoning} if reasoning else {}
        if self.calling is None:
            return {**delta, "content": text} if text else delta
        stream = self.tool_streams.setdefault(c.index, ToolCallStream(self.calling))
        whole = self.reasoning is None or self.calling.reads_channels
        return {**delta, **stream.delta(c.text if whole else split.content, final)}

    def called(self, index: int) -> bool:
        """Whether choice `index` has streamed a tool call."""
        return index in self.tool_streams and self.tool_streams[index].called

    @staticmethod
    def finish_reason(c: CompletionOutput, called: bool) -> str | None:
        return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason

    def logprobs(self, ids: list[int], entries: list) -> dict | None:
        return None if self.k is None else {"content": chat_logprobs(self.served.piece, ids, entries, self.k)}

    def items(self, d: Delta) -> list[dict]:
        c = d.choice
        items = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}] if d.first else []
        delta = self.message_delta(d)
        if delta or (self.k is not None and d.token_ids) or c.finish_reason:
            called = self.called(c.index)
            item = {"index": c.index, "delta": delta, "logprobs": self.logprobs(d.token_ids, d.logprobs),
                    "finish_reason": self.finish_reason(c, called)}
            if c.finish_reason is not None:
                item["stop_reason"] = c.stop_reason
            items.append(item)
        return items

    def response_choice(self, c: CompletionOutput) -> dict:
        reasoning, text = (None, c.text) if self.reasoning is None else self.reasoning.split(c.text, self.thinking)
        if self.calling is None:
            message = {"role": "assistant", "content": text}
        else:
            message = self.calling.message(c.text if self.calling.reads_channels else text)
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        return {
            "index": c.index,
            "message": message,
            "logprobs": self.logprobs(c.token_ids, c.logprobs or []),
            "finish_reason": self.finish_reason(c, "tool_calls" in message),
            "stop_reason": c.stop_reason,
        }


def render_chat(s: ServedModel, messages: list[dict], add_generation_prompt: bool, continue_final: bool,
                tools: list | None, kwargs: dict | None, chat_template: str | None = None) -> str:
    extra = {**({"tools": tools} if tools is not None else {}), **(kwargs or {})}
    return s.tokenizer.chat_text(messages, add_generation_prompt, continue_final, s.chat_template(chat_template),
                                 **extra)


def chat_text(s: ServedModel, messages: list[dict], tools: list | None, tool_choice: Any, parallel: bool | None,
              add_generation_prompt: bool = True, continue_final: bool = False, kwargs: dict | None = None,
              chat_template: str | None = None) -> tuple[str, ToolCalling | None]:
    """A conversation's prompt text and its tool calling: with tools the template ignores, in the
    generic format (hearth/server/tool_fallback.py)."""
    calling = tool_calling(tools, tool_choice, parallel, s.tool_call_parser)
    if calling is not None:
        template = s.chat_template(chat_template)

        def render(conversation: list[dict], tools: list | None) -> str:
            return s.tokenizer.apply_chat_template(conversation, add_generation_prompt, template, tools=tools,
                                                   **(kwargs or {}))

        if template_drops_tools(render, messages, tools, template or s.tokenizer.chat_template):
            messages = generic_messages(messages, tools, tool_choice == "required")
            calling, tools = generic_calling(calling, tools, tool_choice, parallel), None
    text = render_chat(s, messages, add_generation_prompt, continue_final, tools, kwargs, chat_template)
    return text, calling


@dataclass
class ChatPrompt:
    """A conversation ready for the engine."""

    ids: list[int]  # its token ids: what the server counts and checks (with_image_tokens: each image's tokens)
    text: str  # what the engine gets with images, and expands their markers in (each image part's, in order)
    images: list[Image.Image]  # decoded, in the order of the conversation's image parts
    calling: ToolCalling | None
    expanded: PromptWithImages | None = None  # with images, after with_image_tokens: what the engine runs
    videos: list[VideoFrames] = dataclasses.field(default_factory=list)  # decoded, sampled, in the parts' order
    mm_processor_kwargs: dict[str, Any] | None = None  # the request's image processor settings (vLLM's)

    def with_images(self, s: ServedModel) -> tuple[str, dict[str, list] | None, dict[str, Any] | None] | None:
        """The text, multi_modal_data and mm_processor_kwargs AsyncEngine.prompt_with_images gets for a prompt with
        images, videos or settings for them (None: none of those; settings without images: only checked)."""
        if not self.images and not self.videos and self.mm_processor_kwargs is None:
            return None
        data = {"image": self.images, "video": self.videos} if self.videos else {"image": self.images}
        return s.tokenizer.chat_prompt_text(self.text), data if self.images or self.videos else None, \
            self.mm_processor_kwargs


async def with_image_tokens(s: ServedModel, prompt: ChatPrompt) -> ChatPrompt:
    """A prompt with images as the engine expands it (its processor's placeholder tokens for each image,
    hearth/engine/images.py): its ids those the engine runs, which the server counts (count_tokens,
    usage, the context length); a prompt without images as it is."""
    request = prompt.with_images(s)
    if request is None:
        return prompt
    expanded = await s.engine.prompt_with_images(*request)
    if expanded is None:
        return prompt
    return dataclasses.replace(prompt, ids=expanded.token_ids, expanded=expanded)


async def chat_prompt(s: ServedModel, body: ChatCompletionRequest) -> ChatPrompt:
    """The conversation's images read (a bad one: 400), then the conversation through the chat template
    (the BOS added, truncated as asked), and its tool calling."""
    images = await s.images.load(body.image_urls())
    videos = await s.images.load_videos(body.video_urls(), s.engine.video_limits)
    if images or videos:
        s.check_images(body.model)
        if body.truncate_prompt_tokens is not None:
            raise APIError(400, "truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens")
    text, calling = await asyncio.to_thread(
        chat_text, s, body.conversation(), body.tools, body.tool_choice, body.parallel_tool_calls,
        body.add_generation_prompt is not False, bool(body.continue_final_message), body.chat_template_kwargs,
        body.chat_template)
    ids = await asyncio.to_thread(s.tokenizer.encode_chat_text, text)
    bos = s.tokenizer.bos_token_id
    if body.add_special_tokens and bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    return ChatPrompt(body.truncate(ids), text, images, calling, videos=videos,
                      mm_processor_kwargs=body.mm_processor_kwargs)


@dataclass
class ChatRun:
    """One chat request in the engine: what chat completions, and the routes that speak other APIs
    (responses.py, messages.py), read their reply from."""

    model: str
    request_id: str
    prompt_tokens: int
    streams: list[RequestStream]
    fmt: ChatFormat  # how the reply reads: content, reasoning, tool calls


async def start_chat(body: ChatCompletionRequest, s: ServedModel, request_id: str,
                     prefill_source: str | None = None, final_only: bool = False) -> ChatRun:
    """Render the conversation and add it to the engine (final_only: for an answer given whole)."""
    model = s.check_model(body.model)
    prompt = await with_image_tokens(s, await chat_prompt(s, body))
    ids, calling = prompt.ids, prompt.calling
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = s.check_length(len(ids), max_tokens)
    k = body.num_logprobs()
    params = body.sampling_params(max_tokens, k, body.prompt_logprobs)
    if calling is not None:
        params = calling.sampling_params(params)
    params = s.reasoning_params(params)
    streams = await s.add_all([ids], params, request_id, prefill_source, body.priority, model,
                              prompt.expanded, final_only)
    return ChatRun(model, request_id, len(ids), streams, ChatFormat(s, k, calling, s.thinking_opened(ids)))


async def start(body: ChatCompletionRequest, s: ServedModel, prefill_source: str | None = None) -> Started:
    """The request in the engine; the route answers from it, and a batch's lines (batches.py) in this process."""
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    run = await start_chat(body, s, request_id, prefill_source, final_only=not body.stream)

    def reply(final: list[RequestOutput]) -> dict:
        data = {"id": request_id, "object": "chat.completion", "created": created, "model": run.model,
                "choices": [run.fmt.response_choice(c) for c in final[0].outputs], "usage": usage(final),
                **hearth_fields(final)}
        if body.prompt_logprobs is not None:
            data["prompt_logprobs"] = prompt_logprobs_json(s.piece, final[0])
        return data

    header = StreamHeader(request_id, created, run.model, body.include_usage, body.continuous_usage)
    return Started(run.streams, header, run.fmt, reply)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, s: Annotated[ServedModel, Depends(served)]):
    return await respond(request, s, start, body)
