"""`hearth generate` and `hearth chat`: their sampling flags, streaming to the terminal, --image's and
--video's prompts, and the chat loop with its commands (/help, /reset, /system, /image, /video, /exit)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from hearth.engine_args import add_engine_arguments, add_model_argument, build_llm
from hearth.errors import HearthError
from hearth.sampling_params import CALM_MEASURES


def add_generate_and_chat(sub) -> None:
    p = sub.add_parser("generate", help="complete a prompt, streaming to the terminal")
    add_model_argument(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for an image-text model (repeatable); the prompt names each with <image>, "
                        "in order (without any, the images go before the text)")
    p.add_argument("--video", action="append", default=[], metavar="FILE",
                   help="a video for Qwen3-VL or Qwen3.5 (repeatable; mp4, webm, mkv... read by PyAV: pip install "
                        "'hearth[video]'), sampled as the model's video processor samples; the prompt names each "
                        "with <|vision_start|><|video_pad|><|vision_end|>, in order (without any, the videos go "
                        "before the text, after the images)")
    p.add_argument("--json", action="store_true")
    _add_sampling(p, max_tokens=128)
    # one sequence at a time: the KV cache holds one context, not a share of memory
    add_engine_arguments(p, max_num_seqs=1)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="talk with the model through its chat template (/help: its commands)")
    add_model_argument(p)
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for the first message (repeatable; later ones: /image FILE)")
    p.add_argument("--video", action="append", default=[], metavar="FILE",
                   help="a video for the first message, for Qwen3-VL or Qwen3.5 (repeatable; later ones: /video FILE)")
    p.add_argument("--json", action="store_true", help="each reply as one JSON line (content, finish_reason, "
                                                       "token counts; reasoning_content with --reasoning-parser)")
    _add_sampling(p, max_tokens=512)
    add_engine_arguments(p, max_num_seqs=1)
    p.set_defaults(func=cmd_chat)


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """generate's and chat's sampling flags, each named after its SamplingParams field (SamplingParams.from_cli)."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g = p.add_argument_group("structured output").add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", default=None, help="the output is JSON valid against this schema")
    g.add_argument("--regex", default=None, help="the whole output matches this regular expression")
    g.add_argument("--grammar", metavar="FILE", default=None,
                   help="the output follows this grammar (Lark syntax or llama.cpp's GBNF)")
    g = p.add_argument_group("watermark")
    g.add_argument("--watermark-key", type=int, default=None, help="watermark the output with this key (0 to 2**32-1)")
    g.add_argument("--watermark-delta", type=float, default=2.0, help="the bias on green tokens")
    g = p.add_argument_group("contrastive decoding (with --contrastive-model)")
    g.add_argument("--contrastive-weight", type=float, default=0.0,
                   help="scores log p_model - WEIGHT * log p_amateur (0: off; Li et al. use 1)")
    g.add_argument("--contrastive-alpha", type=float, default=0.1,
                   help="only tokens with p_model >= ALPHA * max p_model are candidates")
    p.add_argument_group("contrastive search").add_argument(
        "--penalty-alpha", type=float, default=0.0, metavar="ALPHA",
        help="contrastive search (Su et al.): of the --top-k (2 to 16) likeliest tokens, the one of most "
             "(1 - ALPHA) p - ALPHA x its hidden state's greatest cosine with the text's (0: off; Su et al. use 0.6)")
    g = p.add_argument_group("CALM early exit (lossy)")
    g.add_argument("--calm-threshold", type=float, default=None, metavar="T",
                   help="a token leaves the model at the first of --calm-exit-layers where its confidence "
                        "(--calm-measure) is at least T (0 to 1; 1: never; default: off)")
    g.add_argument("--calm-measure", choices=CALM_MEASURES, default="softmax",
                   help="the confidence: softmax (top-1 minus top-2 probability of the intermediate prediction, "
                        "an LM head pass per check), saturation (the cosine of the hidden states after the exit "
                        "layer and the layer before, no LM head), saturation-softmax (the softmax response, computed "
                        "only where the saturation reaches --calm-saturation-bound)")
    g.add_argument("--calm-saturation-bound", type=float, default=0.9, metavar="COS",
                   help="saturation-softmax's loose bound on the saturation (-1 to 1)")


def _sampling(args):
    from hearth.sampling_params import SamplingParams

    return SamplingParams.from_cli(args)


def _stream(llm, prompt, params) -> str:
    """Print the reply as it grows; return its full text."""
    shown = ""
    output = None
    for output in llm.stream(prompt, params):
        text = output.outputs[0].text
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
    return shown if output is None else output.outputs[0].text


def _generate_prompt(text: str, images: list | None, processor=None, videos: list | None = None,
                     video_processor=None):
    """--prompt, or with --image / --video the prompt dict with its media (the model's image part, as its chat
    template writes one, put before the text once per image when the text names none, and likewise each video's
    part; processor: the model's image processor, None for a model without: its images are refused by the
    engine; video_processor: its video processor, never None with videos)."""
    if not images and not videos:
        return text
    from hearth.image_processor import IMAGE_MARKER

    marker, part = (IMAGE_MARKER, IMAGE_MARKER) if processor is None else (processor.marker, processor.template_part)
    if videos and video_processor.marker not in text:
        text = video_processor.marker * len(videos) + text
    data = {"image": images or [], "video": videos} if videos else {"image": images}
    return {"prompt": text if not images or marker in text else part * len(images) + text, "multi_modal_data": data}


def _read_media_files(args) -> tuple[list, list[tuple[str, bytes]]]:
    """--image's files decoded and --video's read (decoded once the model says how to sample them): a bad image or
    an unreadable file fails before the model loads. PIL is imported for them only."""
    if not args.image and not args.video:
        return [], []
    from hearth.images import read_file_bytes, read_image_file

    return ([read_image_file(Path(p), "--image") for p in args.image],
            [(p, read_file_bytes(Path(p), "--video")) for p in args.video])


def cmd_generate(args) -> None:
    params = _sampling(args)  # a bad option, image or unreadable video file fails before the model loads
    images, video_files = _read_media_files(args)
    llm = build_llm(args)
    with contextlib.closing(llm.engine):  # a disk tier (--kv-cache-dir) gets the cached blocks for the next run
        videos = _decoded_videos(llm, video_files)
        prompt = _generate_prompt(args.prompt, images or None, getattr(llm.engine, "image_processor", None), videos,
                                  getattr(llm.engine, "video_processor", None))
        if args.json:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            completion = out.outputs[0]
            print(json.dumps({
                "prompt": args.prompt,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(completion.token_ids),
                **({} if out.cascade is None else {"cascade": out.cascade.summary(len(completion.token_ids))}),
            }))
            return
        sys.stdout.write(args.prompt)
        _stream(llm, prompt, params)
        sys.stdout.write("\n")


def _decoded_videos(llm, files: list[tuple[str, bytes]], what: str = "--video") -> list | None:
    """--video's (or /video's) files decoded and sampled for the loaded model (hearth/videos.py); VideoError for a
    model that takes no videos, a file that is no video, or PyAV missing."""
    if not files:
        return None
    from hearth.chat_images import local_video_limits
    from hearth.videos import VideoError, decode_video

    limits = local_video_limits(getattr(llm.engine, "video_processor", None))
    if limits is None:
        raise VideoError(f"{what}: this model takes no videos: hearth runs the videos of Qwen3-VL and Qwen3.5")
    return [decode_video(data, limits, f"{what} ({path})") for path, data in files]


CHAT_COMMANDS = """commands (not sent to the model):
  /help          this list
  /reset         forget the conversation (the system message stays)
  /system TEXT   the system message from now on (/system alone: none)
  /image FILE    an image for your next message (an image-text model's; --mmproj for a GGUF)
  /video FILE    a video for your next message (Qwen3-VL's, Qwen3.5's)
  /exit          leave (as does end of input)"""


def _chat_command(line: str, history: list[dict], media: list[dict], llm) -> bool:
    """Do a chat command (a line starting with '/'); False: leave. Its messages go to stderr. /image's and
    /video's media wait in `media` (content parts, in order) for the next message."""
    name, _, text = line.partition(" ")
    if name in ("/exit", "/quit"):
        return False
    if name in ("/image", "/video"):
        try:
            media.append(_media_part(llm, name, text.strip()))
            print(f"({name[1:]} attached to your next message: {len(media)} so far)", file=sys.stderr)
        except HearthError as e:
            print(e, file=sys.stderr)
    elif name == "/help":
        print(CHAT_COMMANDS, file=sys.stderr)
    elif name == "/reset":
        del history[1 if history and history[0]["role"] == "system" else 0:]
        print("(conversation cleared)", file=sys.stderr)
    elif name == "/system":
        if history and history[0]["role"] == "system":
            del history[0]
        if text.strip():
            history.insert(0, {"role": "system", "content": text.strip()})
        print("(system message set)" if text.strip() else "(no system message)", file=sys.stderr)
    else:
        print(f"unknown command {name}: /help lists them", file=sys.stderr)
    return True


def _media_part(llm, command: str, path: str) -> dict:
    """The content part of /image's or /video's file: the image decoded, the video decoded and sampled once
    (LLM.chat_prompt reads the whole history every turn); HearthError where the file cannot be read."""
    from hearth.images import read_file_bytes, read_image_file

    if command == "/image":
        return {"type": "image_pil", "image_pil": read_image_file(Path(path), command)}
    return {"type": "video", "video": _decoded_videos(llm, [(path, read_file_bytes(Path(path), command))], command)[0]}


def _chat_reply(llm, history: list[dict], params, as_json: bool) -> str:
    """Generate the next reply (streamed to the terminal, or one JSON line); the answer to keep in the
    history (with a reasoning parser: without the thinking)."""
    prompt = llm.chat_prompt(history)  # token ids, or with images the text and its images
    reasoning = llm.engine.reasoning
    if as_json:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        completion = out.outputs[0]
        text = completion.text
    else:
        text = _stream(llm, prompt, params)
        sys.stdout.write("\n")
    thinking, content = None, text
    if reasoning is not None:
        opened = reasoning.opened_by(prompt["prompt"] if isinstance(prompt, dict) else
                                     llm.get_tokenizer().decode(prompt[-32:], skip_special_tokens=False))
        thinking, content = reasoning.split(text, opened)
    if as_json:
        record = {"role": "assistant", "content": content, "finish_reason": completion.finish_reason,
                  "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(completion.token_ids)}
        print(json.dumps(record | ({} if reasoning is None else {"reasoning_content": thinking}),
                         ensure_ascii=False), flush=True)
    return content


def cmd_chat(args) -> None:
    params = _sampling(args)  # a bad option, image or unreadable video file fails before the model loads
    images, video_files = _read_media_files(args)
    llm = build_llm(args)
    with contextlib.closing(llm.engine):  # a disk tier (--kv-cache-dir) gets the cached blocks for the next run
        history: list[dict] = []
        # content parts for the next message: --image's and --video's, then /image's and /video's
        media = [{"type": "image_pil", "image_pil": image} for image in images] + \
            [{"type": "video", "video": video} for video in _decoded_videos(llm, video_files) or []]
        if args.system:
            history.append({"role": "system", "content": args.system})
        interactive = sys.stdin.isatty()
        if interactive:
            print("/help lists the commands", file=sys.stderr)
        while True:
            if interactive:
                sys.stdout.write("> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
            if line.startswith("/"):
                if not _chat_command(line.strip(), history, media, llm):
                    break
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": [*media, {"type": "text", "text": line}] if media else line})
            media.clear()
            history.append({"role": "assistant", "content": _chat_reply(llm, history, params, args.json)})
