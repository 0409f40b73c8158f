"""LLM: the offline Python API, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hearth.engine_config import EngineConfig
from hearth.engine.beam_search import BeamSearchOutput, beam_search
from hearth.engine.cascade import CascadeEngine
from hearth.engine.engine import LLMEngine
from hearth.errors import RequestError
from hearth.lora_request import LoRARequest
from hearth.options import build, keywords_of
from hearth.outputs import RequestOutput
from hearth.sampling_params import BeamSearchParams, SamplingParams

# text, token ids, or vLLM's TextPrompt {"prompt": text} / TokensPrompt {"prompt_token_ids": ids}, either with
# "multi_modal_data": {"image": [PIL images]} (an image-text model's; the text names each image with <image>) and
# "mm_processor_kwargs": the image processor's settings for them (Gemma 3's {"do_pan_and_scan": True}, ...)
Prompt = str | list[int] | dict[str, Any]
_PROMPT_EXTRAS = ("multi_modal_data", "mm_processor_kwargs")
Conversation = list[dict[str, Any]]


class LLM:
    """Generate from many prompts at once through the continuous-batching engine.

    model: a GGUF file, a Hugging Face folder, "builtin", or None for the default model
    (SmolLM2-135M-Instruct, fetched once: hearth/default_model.py).

    >>> llm = LLM(model="model.gguf")
    >>> out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32, temperature=0))
    >>> out[0].outputs[0].text
    """

    @keywords_of(EngineConfig)
    def __init__(self, model: str | Path | None = None, *, progress: bool = True, **engine_options: Any):
        """engine_options: the engine's options by their flat names, as vLLM's (max_num_seqs=8,
        kv_cache_memory=1 << 30, speculative_method="ngram", ...), declared once in EngineConfig
        (hearth/engine_config.py) with their defaults and help; `hearth generate --help` lists them as flags.
        TypeError for a name that is not one."""
        config = build(EngineConfig, engine_options, "LLM()")
        self.engine = LLMEngine(model, config, progress) if config.cascade.models is None else \
            CascadeEngine.build(model, config, progress)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order. lora_request: the LoRA adapter of
        every prompt, or one per prompt (None: the base model); needs enable_lora."""
        prompts = _as_list(prompts)
        params = _params_for(prompts, sampling_params)
        loras = [lora_request] * len(prompts) if not isinstance(lora_request, (list, tuple)) else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = []
        try:
            for (prompt, images, settings), p, lora in zip(prompts, params, loras):
                ids.append(self.engine.add_request(None, prompt, p, lora_request=lora, multi_modal_data=images,
                                                   mm_processor_kwargs=settings))
        except RequestError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        from tqdm import tqdm

        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update()
        return [finished[i] for i in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (cumulative text)."""
        prompt, images, settings = _unwrapped(prompt)
        request_id = self.engine.add_request(None, prompt, sampling_params, multi_modal_data=images,
                                             mm_processor_kwargs=settings)
        try:
            while True:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The `beam_width` best continuations of each prompt (see hearth/engine/beam_search.py)."""
        prompts = _as_list(prompts)
        if any(images is not None for _, images, _ in prompts):
            raise RequestError("beam search with images (multi_modal_data) is not implemented by hearth")
        prompt_ids = [self.engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p, _, _ in prompts]
        return beam_search(self.engine, prompt_ids, params)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template (and the
        LoRA adapter of lora_request: see generate). A message's content may hold images among its parts
        for an image-text model, as vLLM's LLM.chat takes them (hearth/chat_images.py: `image_url` parts
        with data URLs or file:// paths, `image_pil` parts, `image` parts with a PIL image or a path), made
        with mm_processor_kwargs' settings (see generate's prompt dicts), and videos for Qwen3-VL and Qwen3.5
        (`video_url` parts with data URLs or file:// paths, sampled as the model's video processor samples)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, add_generation_prompt, chat_template_kwargs, mm_processor_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def chat_prompt(self, conversation: Conversation, add_generation_prompt: bool = True,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    mm_processor_kwargs: dict[str, Any] | None = None) -> Prompt:
        """A conversation's prompt for generate: its token ids through the chat template, or with images or
        videos (hearth/chat_images.py) vLLM's prompt dict, the text with their markers and the media; with
        mm_processor_kwargs, a prompt dict that holds them too (checked by the engine even without images)."""
        from hearth.chat_images import conversation_media, local_video_limits  # (PIL: paid for by chats only)

        limits = local_video_limits(getattr(self.engine, "video_processor", None))
        messages, images, videos = conversation_media(conversation, limits)
        settings = {} if mm_processor_kwargs is None else {"mm_processor_kwargs": mm_processor_kwargs}
        if not images and not videos:
            ids = self.render_chat(conversation, add_generation_prompt, chat_template_kwargs)
            return {"prompt_token_ids": ids, **settings} if settings else ids
        tokenizer = self.engine.tokenizer
        text = tokenizer.chat_text(messages, add_generation_prompt, **(chat_template_kwargs or {}))
        data = {"image": images, "video": videos} if videos else {"image": images}
        return {"prompt": tokenizer.chat_prompt_text(text), "multi_modal_data": data, **settings}

    def render_chat(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the chat template."""
        return self.engine.tokenizer.encode_chat(conversation, add_generation_prompt, **(chat_template_kwargs or {}))


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[tuple[str | list[int], dict | None, dict | None]]:
    if isinstance(prompts, (str, dict)):
        return [_unwrapped(prompts)]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [(prompts, None, None)]  # one prompt given as token ids
    return [_unwrapped(p) for p in prompts]


def _unwrapped(prompt: Prompt) -> tuple[str | list[int], dict | None, dict | None]:
    """vLLM's prompt dicts as the text or token ids they hold, their multi_modal_data and mm_processor_kwargs;
    other prompts as they are, without."""
    if not isinstance(prompt, dict):
        return prompt, None, None
    extras = [prompt.get(key) for key in _PROMPT_EXTRAS]
    keys = set(prompt) - set(_PROMPT_EXTRAS)
    if keys == {"prompt"}:
        return prompt["prompt"], *extras
    if keys == {"prompt_token_ids"}:
        return list(prompt["prompt_token_ids"]), *extras
    raise RequestError(f"a prompt dict holds either 'prompt' (text) or 'prompt_token_ids' (and maybe "
                       f"{' and '.join(map(repr, _PROMPT_EXTRAS))}), nothing else; got the keys "
                       f"{sorted(map(str, prompt))}")


def _params_for(prompts: list[Prompt], params) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in prompts]
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    return params
