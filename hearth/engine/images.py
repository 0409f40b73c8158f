"""Images in a request: the prompt's markers expanded into the model's placeholder tokens, where each
image's rows lie (ImageSpan, on the Request: no tensors), the encoder cache, and for the runner a step's
rows of image embeddings, its M-RoPE positions (Qwen3-VL) and the images whose tokens attend both ways
(Gemma 3 and 4: image_blocks, a block per run of an image's placeholders: pan and scan's crops apart).

A prompt names each image with the model's marker (`<image>`, Qwen3-VL's `<|image_pad|>`, Gemma 3's
`<start_of_image>`, Gemma 4's `<|image|>`: as its chat template writes an image content part), once per image
of multi_modal_data["image"], in order; Qwen3-VL's and Qwen3.5's videos (multi_modal_data["video"]) each with
<|vision_start|><|video_pad|><|vision_end|>, a video becoming one span per frame group (each encoded as an image,
with <|video_pad|> its placeholder: hearth/video_processor_qwen.py). Each marker becomes the text the model's processor makes of it
(hearth/image_processor.py, image_processor_qwen.py, image_processor_gemma.py, image_processor_gemma4.py)
before the prompt is tokenized, so the
token ids are the processor's. The k-th image's embeddings take the places of the next
num_embeds placeholder tokens (image_token_id), in order, as transformers' masked_scatter fills them.

The encoder cache keeps each image's embeddings by its content hash (of its pixels, and of the processor's settings
a request may change: the same image made another way is another entry), least recently used first out
past `max_rows` rows: an image seen again (in this prompt, another request, or the next chunk of
this one) is not encoded again. It is only a cache: a miss encodes.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hearth.engine.request import ImageSpan, Request
from hearth.errors import RequestError
from hearth.videos import VideoFrames

if TYPE_CHECKING:
    import torch

    from hearth.image_processor import ImageProcessor
    from hearth.image_processor_gemma import GemmaImageProcessor
    from hearth.image_processor_gemma4 import Gemma4ImageProcessor
    from hearth.image_processor_qwen import QwenImageProcessor

    from hearth.tokenizer import Tokenizer


# the encoder cache's bound, in embeddings (a few images' worth: SmolVLM's largest image is 17 x 64)
ENCODER_CACHE_ROWS = 8192


def media_of(multi_modal_data: Any, kind: str) -> list:
    """multi_modal_data's images or videos (vLLM's shape: {"image": an image or a list of them, "video": a video
    or a list of them}; a video itself may be a list of frames: a list of videos is a list of lists, arrays or
    (frames, metadata) pairs)."""
    if multi_modal_data is None:
        return []
    if not isinstance(multi_modal_data, dict) or set(multi_modal_data) - {"image", "video"}:
        kinds = sorted(multi_modal_data) if isinstance(multi_modal_data, dict) else type(multi_modal_data).__name__
        raise RequestError(f"multi_modal_data holds {{'image': [images], 'video': [videos]}}; got {kinds}")
    items = multi_modal_data.get(kind)
    if items is None:
        return []
    if kind == "video":  # one video: an array, a (frames, metadata) pair, or a list of frames (PIL images)
        single = not isinstance(items, list) or (items and not isinstance(items[0], (list, tuple, np.ndarray,
                                                                                     VideoFrames)))
        return [items] if single else list(items)
    return list(items) if isinstance(items, (list, tuple)) else [items]


@dataclass(frozen=True)
class PromptWithImages:
    """A prompt's text, its token ids with every image's placeholders, and the images' spans (a video's: one
    span per frame group)."""

    text: str
    token_ids: list[int]
    images: list[ImageSpan]


@dataclass(frozen=True)
class Media:
    """One kind of a prompt's media: the processor that makes its placeholder text, and its placeholder token."""

    kind: str  # "image", "video"
    processor: Any  # an image processor, or hearth/video_processor_qwen.py's
    token_id: int | None
    token: str  # the placeholder token's text


def expand_prompt(prompt: str | list[int], multi_modal_data: Any,
                  processor: ImageProcessor | QwenImageProcessor | GemmaImageProcessor | Gemma4ImageProcessor | None,
                  tokenizer: Tokenizer, image_token_id: int | None,
                  videos: Media | None = None, mm_processor_kwargs: dict[str, Any] | None = None
                  ) -> PromptWithImages | None:
    """A prompt with images and videos (multi_modal_data, vLLM's) expanded, the images made by the processor with
    mm_processor_kwargs' settings (vLLM's: Gemma 3's do_pan_and_scan, ...); None for a prompt without, for the
    engine's own encoding (processor None: a text model, which the engine lets no images reach; videos None: a
    model that takes no videos). RequestError for markers and media that do not pair up, token ids that hold
    placeholders, settings the processor does not take. Reads no engine state (the AsyncEngine runs it off the
    engine's thread)."""
    if processor is None:
        if mm_processor_kwargs:
            raise RequestError("mm_processor_kwargs: this model has no image processor (no vision encoder)")
        return None
    if mm_processor_kwargs is not None:
        processor = processor.with_options(mm_processor_kwargs)
    kinds = [Media("image", processor, image_token_id, processor.image_token)]
    if multi_modal_data is not None and media_of(multi_modal_data, "video"):
        if videos is None:
            raise RequestError("this model takes no videos (multi_modal_data['video']): hearth runs the videos of "
                               "Qwen3-VL and Qwen3.5")
        kinds.append(videos)
    given = {m.kind: media_of(multi_modal_data, m.kind) for m in kinds}
    if not isinstance(prompt, str):
        if any(given.values()) or any(m.token_id in prompt for m in kinds):
            raise RequestError(f"images go with a text prompt that names each with {processor.marker}, not token ids")
        return None
    for m in kinds:
        markers = prompt.count(m.processor.marker)
        if markers != len(given[m.kind]):
            raise RequestError(f"the prompt names {markers} {m.kind}(s) with {m.processor.marker} and "
                               f"{len(given[m.kind])} {m.kind}(s) were given: each {m.kind} needs its "
                               f"{m.processor.marker} in the text, in order")
    if not any(given.values()):
        return None
    processed = {m.kind: [m.processor.process(item) for item in given[m.kind]] for m in kinds}
    text = _expanded_text(prompt, kinds, processed)
    ids = tokenizer.encode(text)
    spans = []
    for m in kinds:
        pieces = [piece for item in processed[m.kind] for piece in getattr(item, "groups", [item])]
        spans += _spans(ids, pieces, m)
    return PromptWithImages(prompt, ids, sorted(spans, key=lambda span: span.start))


def _expanded_text(prompt: str, kinds: list[Media], processed: dict[str, list]) -> str:
    """The prompt with each marker replaced by its item's placeholder text, markers of every kind in their order."""
    pattern = "|".join(re.escape(m.processor.marker) for m in kinds)
    by_marker = {m.processor.marker: (m.processor, iter(processed[m.kind])) for m in kinds}

    def placeholder(match: re.Match) -> str:
        made, items = by_marker[match.group()]
        return made.placeholder_text(next(items))

    return re.sub(pattern, placeholder, prompt)


def _spans(ids: list[int], pieces: list, media: Media) -> list[ImageSpan]:
    """The spans of `pieces` (images, or videos' frame groups) over their placeholder tokens, in order."""
    positions = np.flatnonzero(np.asarray(ids) == media.token_id)
    needed = sum(piece.num_embeds for piece in pieces)
    if len(positions) != needed:  # (the text's own placeholders, or a tokenizer that reads them otherwise)
        raise RequestError(f"the prompt holds {len(positions)} {media.kind} placeholder tokens ({media.token_id}) where "
                           f"its {media.kind}s take {needed}: the text has placeholders of its own, or the tokenizer "
                           f"does not read {media.token} as that token")
    spans, used = [], 0
    for piece in pieces:
        mine = positions[used:used + piece.num_embeds]
        used += piece.num_embeds
        runs = np.split(mine, np.flatnonzero(np.diff(mine) > 1) + 1)
        spans.append(ImageSpan(int(mine[0]), int(mine[-1]) + 1, piece.content_hash, piece.pixel_values,
                               piece.num_embeds, piece.grid, tuple((int(r[0]), int(r[-1]) + 1) for r in runs),
                               None if media.kind == "image" else media.token_id))
    return spans


class EncoderCache:
    """Image embeddings [rows, hidden] by content hash, least recently used evicted past max_rows."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.rows = 0
        self.hits = self.misses = 0

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self.entries

    def embeddings(self, image: ImageSpan,
                   encode: Callable[[np.ndarray, tuple[int, int] | None], torch.Tensor]) -> torch.Tensor:
        """The image's embeddings, from the cache or encoded now (and kept)."""
        found = self.entries.get(image.content_hash)
        if found is not None:
            self.hits += 1
            self.entries.move_to_end(image.content_hash)
            return found
        self.misses += 1
        found = encode(image.pixel_values, image.grid)
        self.entries[image.content_hash] = found
        self.rows += len(found)
        while self.rows > self.max_rows and len(self.entries) > 1:
            _, evicted = self.entries.popitem(last=False)
            self.rows -= len(evicted)
        return found


def step_embeddings(request: Request, start: int, count: int, image_token_id: int, cache: EncoderCache,
                    encode: Callable[[np.ndarray, tuple[int, int] | None], torch.Tensor]
                    ) -> tuple[np.ndarray, list[torch.Tensor]] | None:
    """The rows among a step's tokens start..start+count-1 of `request` that hold image embeddings
    (indices from the step's first token, int64 [k]) and their values (one tensor per image, in order);
    None when no image token is among them. A chunk may begin or end inside an image."""
    rows, values = [], []
    end = start + count
    for image in request.images:
        low, high = max(start, image.start), min(end, image.end)
        if low >= high:
            continue
        placeholder = image_token_id if image.token_id is None else image.token_id  # (a video's: its own)
        is_image = np.asarray(request.all_token_ids[image.start:high]) == placeholder
        index = np.cumsum(is_image) - 1  # each position's row among the image's embeddings
        local = np.flatnonzero(is_image[low - image.start:]) + (low - image.start)
        if len(local):
            rows.append(local + (image.start - start))
            values.append(cache.embeddings(image, encode)[index[local]])
    return (np.concatenate(rows), values) if rows else None


def image_blocks(images: Sequence[Sequence[ImageSpan]], starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """The runs of image tokens that attend to each other both ways (StepInputs.image_blocks: each image's
    placeholders, or each of its crops', ImageSpan.blocks) among a step's sequences (images[s]: sequence s's,
    whose new rows are its positions starts[s]..ends[s]-1): int64 [N, 3] (sequence, first position, end
    position) of each that has rows among them; None: none has."""
    found = [(s, low, high) for s, spans in enumerate(images) for image in spans for low, high in image.blocks()
             if low < ends[s] and high > starts[s]]
    return np.array(found, dtype=np.int64) if found else None


def mrope_positions(positions: np.ndarray, images: Sequence[ImageSpan]) -> np.ndarray:
    """M-RoPE's positions int64 [3, n] (time, height, width) of a sequence's rows at token indices
    `positions` [n] (transformers' Qwen3-VL get_rope_index): an image's k-th token at (p, p + k // cols,
    p + k % cols), p its first token's own position; every token after an image shifted by the grid's
    longer side less its token count (the rope delta: a decode after an image, a chunk after one)."""
    out = np.broadcast_to(positions, (3, len(positions))).copy()
    shift = 0
    for image in sorted(images, key=lambda i: i.start):
        rows, cols = image.grid
        inside = (positions >= image.start) & (positions < image.end)
        k = positions[inside] - image.start
        first = image.start + shift
        out[0, inside], out[1, inside], out[2, inside] = first, first + k // cols, first + k % cols
        delta = max(rows, cols) - image.num_embeds
        out[:, positions >= image.end] += delta
        shift += delta
    return out
