"""llama.cpp's mmproj GGUF files: an image-text model's vision tower beside its text model's GGUF
(`llama-server -m TEXT.gguf --mmproj MMPROJ.gguf`), read and written for the projector types hearth
implements: clip.cpp's "idefics3" (SmolVLM / Idefics3: SigLIP, pixel shuffle, a linear projector),
"gemma3" (Gemma 3: SigLIP, an average pool, the soft-embedding norm and a linear projector) and "gemma4v"
(Gemma 4's ViT: what its file holds and leaves out in hearth/loading/mmproj_gemma4.py).

The layout is gguf-py's (llama.cpp's own package), as convert_hf_to_gguf.py's SmolVLMModel and
Gemma3VisionModel write it: general.architecture "clip" and general.type "mmproj"; the keys of
gguf.Keys.Clip / Keys.ClipVision (clip.vision.image_size, .patch_size, .projector.scale_factor (clip.cpp's
default where absent: 2 for idefics3, 4 for gemma3), .image_mean, ..., .preproc_image_size: Idefics3's
longest edge); the tensors named by gguf-py's MMPROJ tensor map (v.patch_embd, v.position_embd, v.blk.N.attn_q
/ ln1 / ffn_up ..., v.post_ln, mm.model.fc; gemma3's mm.input_projection, F16 as its converter forces it,
and mm.soft_emb_norm, stored as the norm's whole weight: the checkpoint's w - 1 plus 1). The file holds no
token ids: the image placeholder is the text model's `<image>` (`<image_soft_token>`) token, found by its
text as llama.cpp's mtmd finds the tokens around images.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import (MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFType, GGUFWriter, Keys,
                  VisionProjectorType, get_tensor_name_map)
from gguf.quants import dequantize

from hearth.config import ModelConfig
from hearth.errors import ModelLoadError
from hearth.image_processor import IMAGE_MARKER, ImageProcessor
from hearth.image_processor_gemma import GemmaImageProcessor
from hearth.image_processor_gemma4 import Gemma4ImageProcessor
from hearth.image_processor_qwen import QwenImageProcessor
from hearth.loading import mmproj_gemma4 as gemma4
from hearth.loading import mmproj_qwen as qwen
from hearth.loading.convert import PlannedTensor, out_types, tensor_type, write_gguf
from hearth.loading.gguf_reader import GGUFFile, TensorInfo, read_gguf
from hearth.loading.safetensors import load_hf_folder
from hearth.model.vision.gemma3 import GemmaVisionTower
from hearth.model.vision.gemma4 import Gemma4VisionTower
from hearth.model.vision.qwen3_vl import QwenVisionTower
from hearth.model.vision.siglip import VisionTower
from hearth.tokenizer import Tokenizer
from hearth.video_processor_qwen import QwenVideoProcessor
from hearth.vision_config import Gemma4VisionConfig, QwenVisionConfig, VisionConfig

Q = GGMLQuantizationType
CLIP = MODEL_ARCH_NAMES[MODEL_ARCH.MMPROJ]  # "clip": every mmproj file's general.architecture
_V = Keys.ClipVision
# the projector types hearth reads and writes -> the vision family (vision_config.py)
# (a qwen3vl_merger file's family: "qwen3_5" before a Qwen3.5 text model, mmproj_qwen.vision_config)
_FAMILIES = {VisionProjectorType.IDEFICS3: "idefics3", VisionProjectorType.GEMMA3: "gemma3", gemma4.PROJECTOR: "gemma4",
             qwen.PROJECTOR: "qwen3_vl"}
_QWEN = ("qwen3_vl", "qwen3_5")
_TOWERS = {"idefics3": VisionTower, "gemma3": GemmaVisionTower, "gemma4": Gemma4VisionTower,
           "qwen3_vl": QwenVisionTower, "qwen3_5": QwenVisionTower}
_SCALE_FACTORS = {"idefics3": 2, "gemma3": 4}  # clip.cpp's where the file names none
# the tokens each family's placeholder text is made of (its processor's placeholder_text), each one token of the
# text model's vocabulary (the first: the placeholder); without them the prompt would tokenize other than the
# processor's
_IMAGE_TOKENS = {"idefics3": (IMAGE_MARKER, "<fake_token_around_image>", "<global-img>", "<row_1_col_1>"),
                 "gemma3": (GemmaImageProcessor.image_token, GemmaImageProcessor.marker, GemmaImageProcessor.end_token),
                 "gemma4": gemma4.IMAGE_TOKENS, "qwen3_vl": qwen.IMAGE_TOKENS}
# tensors the file stores shifted from the checkpoint: gemma3's soft-embedding norm, its weight w - 1 in the
# checkpoint (Gemma's RMSNorm multiplies by 1 + w), whole in the file (clip.cpp's norm multiplies by it)
_FILE_OFFSETS = {"mm.soft_emb_norm.weight": 1.0}
_AUDIO = ("a.", "mm.a.")  # an audio tower's tensors in a file that has one (gguf-py's A_* names)
_DENSE = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


@dataclass
class Mmproj:
    """An mmproj file read for a text model: the vision config, the tower's weights by hearth's
    checkpoint names (model.vision_model.*, model.connector.*; Gemma 3's model.vision_tower.*,
    model.multi_modal_projector.*; Gemma 4's model.vision_tower.*, model.embed_vision.*) and the images' processor."""

    vision: VisionConfig | Gemma4VisionConfig | QwenVisionConfig
    weights: dict[str, torch.Tensor]
    image_processor: ImageProcessor | GemmaImageProcessor | Gemma4ImageProcessor | QwenImageProcessor
    video_processor: QwenVideoProcessor | None = None  # Qwen3-VL's and Qwen3.5's (mmproj_qwen.with_videos)


def read_mmproj(path: str | Path, text: ModelConfig, tokenizer: Tokenizer) -> Mmproj:
    """The mmproj file at `path` for the text model `text` (with `tokenizer`); ModelLoadError that says
    what does not fit: not an mmproj, another projector type, a missing or misshapen tensor, a
    projector for another width, a text model without the image tokens."""
    where = str(path)
    if text.vision is not None:
        raise ModelLoadError(f"{where}: the model has its own vision tower; an mmproj file goes with a text model")
    file = read_gguf(path)
    md = file.metadata
    family = _family(md, where)
    videos = None
    try:
        token = _image_token(tokenizer, family, where)
        if family in ("gemma4", "qwen3_vl"):
            module = gemma4 if family == "gemma4" else qwen
            vision = module.vision_config(md, {t.name: tuple(reversed(t.shape)) for t in file.tensors}, text, token)
            processor = module.image_processor(md, vision)
            if family == "qwen3_vl":
                vision, videos = qwen.with_videos(vision, processor, tokenizer)
        else:
            vision = _vision_config(md, family, token)
            processor = _image_processor(md, vision, where)
    except ModelLoadError as e:
        raise ModelLoadError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise ModelLoadError(f"{where}: malformed metadata: {e}") from None
    width = md.get(_V.PROJECTION_DIM)
    if width != text.hidden_size:
        raise ModelLoadError(f"{where}: the projector makes embeddings of {width} ({_V.PROJECTION_DIM}), the text "
                             f"model's are {text.hidden_size}: this mmproj file is another model's")
    return Mmproj(vision, _read_tensors(file, vision, text.hidden_size, where), processor, videos)


def _family(md: dict[str, Any], where: str) -> str:
    """The vision family of an mmproj file's projector; ModelLoadError for a file that is none, or one of
    another projector type."""
    arch = md.get(Keys.General.ARCHITECTURE)
    if arch != CLIP:
        raise ModelLoadError(f"{where}: not an mmproj file (general.architecture is {arch!r}, not {CLIP!r}): "
                             "--mmproj takes the vision projector file that goes beside the text model's GGUF")
    if not md.get(Keys.Clip.HAS_VISION_ENCODER):
        raise ModelLoadError(f"{where}: the mmproj file has no vision encoder ({Keys.Clip.HAS_VISION_ENCODER})")
    kind = md.get(Keys.Clip.PROJECTOR_TYPE, md.get(_V.PROJECTOR_TYPE))
    if kind not in _FAMILIES:
        raise ModelLoadError(f"{where}: projector type {kind!r} ({Keys.Clip.PROJECTOR_TYPE}) is not implemented by "
                             f"hearth; it reads {VisionProjectorType.IDEFICS3!r} projectors (SmolVLM, Idefics3), "
                             f"{VisionProjectorType.GEMMA3!r} (Gemma 3), {gemma4.PROJECTOR!r} (Gemma 4) and "
                             f"{qwen.PROJECTOR!r} ones (Qwen3-VL, Qwen3.5)")
    return _FAMILIES[kind]


def _image_token(tokenizer: Tokenizer, family: str, where: str) -> int:
    """The id of the text model's image placeholder token; ModelLoadError where the placeholder text's
    tokens are not single special tokens of its vocabulary."""
    for text in _IMAGE_TOKENS[family]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1 or not tokenizer.is_special(ids[0]):
            raise ModelLoadError(f"{where}: the text model has no {text} token (it tokenizes as {ids}): a {family} "
                                 f"projector goes with a {family} text model, whose vocabulary has the image tokens")
    return tokenizer.encode(_IMAGE_TOKENS[family][0], add_special_tokens=False)[0]


def _vision_config(md: dict[str, Any], family: str, image_token_id: int) -> VisionConfig:
    def get(key: str) -> Any:
        if key not in md:
            raise ModelLoadError(f"missing metadata key {key}")
        return md[key]

    if md.get(Keys.ClipVision.USE_GELU) is not True:
        raise ModelLoadError(f"{Keys.ClipVision.USE_GELU} is not true: hearth's {family} encoder runs GELU")
    return VisionConfig(
        family=family, hidden_size=get(_V.EMBEDDING_LENGTH), intermediate_size=get(_V.FEED_FORWARD_LENGTH),
        num_layers=get(_V.BLOCK_COUNT), num_heads=get(_V.Attention.HEAD_COUNT), image_size=get(_V.IMAGE_SIZE),
        patch_size=get(_V.PATCH_SIZE), scale_factor=md.get(_V.Projector.SCALE_FACTOR, _SCALE_FACTORS[family]),
        image_token_id=image_token_id, layer_norm_eps=float(md.get(_V.Attention.LAYERNORM_EPS, 1e-6)))


def _image_processor(md: dict[str, Any], vision: VisionConfig, where: str) -> ImageProcessor | GemmaImageProcessor:
    """The family's processor with the file's settings: Gemma 3's images resized to the encoder's image_size;
    Idefics3's tiles of it, the longest edge clip.vision.preproc_image_size (without it, as llama.cpp: the
    image resized to one tile, through its longest edge at the tile's size as transformers' processor does
    without splitting)."""
    mean, std = tuple(md.get(_V.IMAGE_MEAN, (0.5, 0.5, 0.5))), tuple(md.get(_V.IMAGE_STD, (0.5, 0.5, 0.5)))
    if vision.family == "gemma3":
        return GemmaImageProcessor(vision, (vision.image_size,) * 2, vision.tokens_per_tile, mean, std)
    longest = md.get(_V.PREPROC_IMAGE_SIZE)
    return ImageProcessor(vision, int(longest or vision.image_size), vision.image_size, vision.tokens_per_tile,
                          mean, std, do_image_splitting=longest is not None).checked(where)


def tower_tensors(vision: VisionConfig | Gemma4VisionConfig, text_hidden_size: int
                  ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """llama.cpp's name (gguf-py's MMPROJ map) -> (hearth's checkpoint name, shape in the file, torch order) of
    every tensor of the vision tower."""
    with torch.device("meta"):
        tower = _TOWERS[vision.family](vision, text_hidden_size)
    names = get_tensor_name_map(MODEL_ARCH.MMPROJ, vision.num_layers)
    tensors = {}
    for name, param in tower.named_parameters():
        checkpoint, shape = f"model.{name}", tuple(param.shape)
        if vision.family in _QWEN:  # (the patch projection: two tensors in the file)
            tensors |= {n: (checkpoint, qwen.file_shape(n, shape)) for n in qwen.gguf_names(vision, checkpoint)}
            continue
        published = gemma4.published_name(checkpoint) if vision.family == "gemma4" else _published_name(checkpoint)
        gguf_name = names.get_name(published, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ModelLoadError(f"tensor {checkpoint}: gguf-py has no mmproj name for it")
        tensors[gguf_name] = (checkpoint, gemma4.file_shape(gguf_name, shape) if vision.family == "gemma4" else shape)
    return tensors


def _published_name(checkpoint: str) -> str:
    """A tower tensor's name as gguf-py's map knows it: SmolVLM's as hearth names it, Gemma 3's as its published
    checkpoints do (vision_tower.vision_model.*, multi_modal_projector.mm_input_projection.weight)."""
    if not checkpoint.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        return checkpoint
    name = re.sub(r"^model\.vision_tower\.", "vision_tower.vision_model.", checkpoint).removeprefix("model.")
    return name.replace("_projection_weight", "_projection.weight")


def _read_tensors(file: GGUFFile, vision: VisionConfig | Gemma4VisionConfig, text_hidden_size: int, where: str
                  ) -> dict[str, torch.Tensor]:
    """Every tower tensor of the file by hearth's name, float32; ModelLoadError for one missing, one
    of another shape, or one the tower has no place for."""
    expected = tower_tensors(vision, text_hidden_size)
    found = {t.name: t for t in file.tensors}
    for name, (_, shape) in expected.items():
        if name not in found:
            raise ModelLoadError(f"{where}: missing tensor {name}")
        if tuple(reversed(found[name].shape)) != shape:
            raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(reversed(found[name].shape))}, expected "
                                 f"{shape} from the file's metadata")
    audio = file.metadata.get(Keys.Clip.HAS_AUDIO_ENCODER) is True  # (Gemma 4 E2B's, E4B's: left unread)
    extra = sorted(name for name in set(found) - set(expected) if not (audio and name.startswith(_AUDIO)))
    if extra:
        raise ModelLoadError(f"{where}: tensor {extra[0]} is not part of the {vision.family} projector hearth "
                             "implements")
    values = {name: _float32(file, found[name], where) - _FILE_OFFSETS.get(name, 0.0) for name in expected}
    if vision.family in _QWEN:  # (the patch projection: a kernel a frame in the file)
        values = qwen.from_file(values)
    elif vision.family == "gemma4":  # (the patch projection: a convolution's kernel in the file)
        values = {name: gemma4.from_file(name, t) for name, t in values.items()}
    return {checkpoint: values[name] for name, (checkpoint, _) in expected.items() if name in values}


def _float32(file: GGUFFile, t: TensorInfo, where: str) -> torch.Tensor:
    """A tensor's values (dequantized by gguf-py where the file quantized them)."""
    shape = tuple(reversed(t.shape))
    data = file.tensor_bytes(t)
    try:
        if t.qtype in _DENSE:
            return torch.from_numpy(data.copy()).view(_DENSE[t.qtype]).reshape(shape).float()
        return torch.from_numpy(dequantize(data.reshape(-1, data.size // shape[0] if shape else 1), t.qtype)
                                .reshape(shape).copy())
    except (ValueError, NotImplementedError, RuntimeError) as e:
        raise ModelLoadError(f"{where}: tensor {t.name} ({t.qtype.name}) cannot be read: {e}") from None


def write_mmproj(hf_dir: str | Path, out_path: str | Path, out_type: str = "f16", progress: bool = True) -> Path:
    """Write the vision tower of the image-text folder `hf_dir` as llama.cpp's mmproj file at
    `out_path` (returned): its metadata as convert_hf_to_gguf.py's SmolVLMModel (Gemma3VisionModel,
    Gemma4VisionAudioModel, Qwen3VLVisionModel) writes it, the embeddings and 1-D tensors F32 (gemma3's input
    projection F16; gemma4's and Qwen's patch projection F16 in an f16 file, F32 otherwise), the other weights in
    `out_type` (F16 where a row is not whole blocks)."""
    file_type, weight_type = out_types(out_type)
    config, weights = load_hf_folder(hf_dir, progress=progress)
    vision = config.vision
    if vision is None:
        raise ModelLoadError(f"{hf_dir}: a text model has no vision tower to write as an mmproj file")
    if vision.family not in _TOWERS or vision.hidden_act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{hf_dir}: a {vision.family} vision tower with vision_config.hidden_act "
                             f"{vision.hidden_act!r}: hearth writes llama.cpp's idefics3, gemma3, gemma4v and "
                             "qwen3vl_merger projectors, which run the tanh GELU (gelu_pytorch_tanh)")
    writer = GGUFWriter(None, CLIP)
    writer.add_type(GGUFType.MMPROJ)
    writer.add_file_type(int(file_type))
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config.hidden_size)
    _add_encoder_sizes(writer, vision, gemma4.IMAGE_SIZE if vision.family == "gemma4"
                       else qwen.image_size(vision) if vision.family in _QWEN else vision.image_size)
    if vision.family == "gemma4":
        gemma4.add_metadata(writer, vision, Gemma4ImageProcessor.from_hf_dir(Path(hf_dir), vision), str(hf_dir))
    elif vision.family in _QWEN:
        qwen.add_metadata(writer, vision, QwenImageProcessor.from_hf_dir(Path(hf_dir), vision), config.rms_norm_eps,
                          str(hf_dir))
    else:
        _add_siglip_metadata(writer, vision, Path(hf_dir))
    plan = _plan(vision.family, tower_tensors(vision, config.hidden_size), weights, weight_type)
    return write_gguf(writer, plan, out_path, f"writing the mmproj file in {out_type}", progress)


def _add_siglip_metadata(writer: GGUFWriter, vision: VisionConfig, hf_dir: Path) -> None:
    """SmolVLMModel's and Gemma3VisionModel's keys but the encoder's sizes."""
    gemma = vision.family == "gemma3"
    processor = (GemmaImageProcessor if gemma else ImageProcessor).from_hf_dir(hf_dir, vision)
    writer.add_clip_projector_type(VisionProjectorType.GEMMA3 if gemma else VisionProjectorType.IDEFICS3)
    writer.add_vision_projector_scale_factor(vision.scale_factor)
    writer.add_vision_image_mean(processor.mean.tolist())
    writer.add_vision_image_std(processor.std.tolist())
    writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    writer.add_vision_use_gelu(True)
    if not gemma and processor.do_image_splitting:
        writer.add_vision_preproc_image_size(processor.longest_edge)


def _add_encoder_sizes(writer: GGUFWriter, vision: VisionConfig | Gemma4VisionConfig | QwenVisionConfig,
                       image_size: int) -> None:
    """The keys every converter's mmproj file has: the image and patch sizes, the encoder's widths, layers, heads."""
    for add, value in ((writer.add_vision_image_size, image_size), (writer.add_vision_patch_size, vision.patch_size),
                       (writer.add_vision_embedding_length, vision.hidden_size),
                       (writer.add_vision_feed_forward_length, vision.intermediate_size),
                       (writer.add_vision_block_count, vision.num_layers),
                       (writer.add_vision_head_count, vision.num_heads)):
        add(value)


def _plan(family: str, tensors: dict[str, tuple[str, tuple[int, ...]]], weights: dict[str, torch.Tensor],
          weight_type: GGMLQuantizationType) -> list[PlannedTensor]:
    """The tower's tensors under llama.cpp's names, in their types (SmolVLMModel's: embeddings F32;
    Gemma3VisionModel's: its input projection F16 too, llama.cpp issue 13025; Gemma4VisionAudioModel's: the
    position table F32, the patch projection F16 or F32), values as the file stores them."""
    missing = [checkpoint for checkpoint, _ in tensors.values() if checkpoint not in weights]
    if missing:
        raise ModelLoadError(f"missing tensor {missing[0]}")
    plan = []
    for name, (checkpoint, shape) in tensors.items():
        tensor = weights[checkpoint]
        qtype = tensor_type(name, tensor, weight_type)
        if ".embeddings." in checkpoint or name == gemma4.POSITIONS:
            qtype = Q.F32
        elif family == "gemma3" and name == "mm.input_projection.weight":
            qtype = Q.F16
        elif family in ("gemma4", *_QWEN) and name in (gemma4.PATCH, qwen.PATCH_1):
            qtype = Q.F16 if weight_type == Q.F16 else Q.F32
        # (gemma4's patch projection: a kernel; Qwen's: a kernel a frame)
        layout = {"gemma4": gemma4.to_file, "qwen3_vl": qwen.to_file, "qwen3_5": qwen.to_file}.get(family)
        offset = _FILE_OFFSETS.get(name, 0.0)
        plan.append((name, shape, qtype, lambda name=name, tensor=tensor, offset=offset, layout=layout:
                     layout(name, tensor.float()) if layout else tensor.float() + offset))
    return plan
