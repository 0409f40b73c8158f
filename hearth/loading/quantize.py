"""`hearth quantize`: an HF folder or an F32/F16/BF16 GGUF -> a quantized GGUF as llama.cpp's
`llama-quantize` writes it: the same type for every tensor (`tensor_types`: llama.cpp's
llama_tensor_get_type, its `_S/_M/_L` mixes included) and, without an importance matrix, the same
bytes (hearth/quant/quantizer). The file is written by convert.py's writer; a GGUF input's metadata
is copied as it is, but for the file type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from hearth.errors import ModelLoadError
from hearth.loading.convert import GGUF_ARCHITECTURES, PlannedTensor, open_hf_folder, write_gguf

Q = GGMLQuantizationType
F = LlamaFileType

# --type -> (general.file_type, the type of most weights)
MIXES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "q8_0": (F.MOSTLY_Q8_0, Q.Q8_0), "q4_0": (F.MOSTLY_Q4_0, Q.Q4_0), "q4_1": (F.MOSTLY_Q4_1, Q.Q4_1),
    "q5_0": (F.MOSTLY_Q5_0, Q.Q5_0), "q5_1": (F.MOSTLY_Q5_1, Q.Q5_1), "q2_k": (F.MOSTLY_Q2_K, Q.Q2_K),
    "q3_k_s": (F.MOSTLY_Q3_K_S, Q.Q3_K), "q3_k_m": (F.MOSTLY_Q3_K_M, Q.Q3_K), "q3_k_l": (F.MOSTLY_Q3_K_L, Q.Q3_K),
    "q4_k_s": (F.MOSTLY_Q4_K_S, Q.Q4_K), "q4_k_m": (F.MOSTLY_Q4_K_M, Q.Q4_K),
    "q5_k_s": (F.MOSTLY_Q5_K_S, Q.Q5_K), "q5_k_m": (F.MOSTLY_Q5_K_M, Q.Q5_K), "q6_k": (F.MOSTLY_Q6_K, Q.Q6_K),
    "iq4_nl": (F.MOSTLY_IQ4_NL, Q.IQ4_NL), "iq4_xs": (F.MOSTLY_IQ4_XS, Q.IQ4_XS),
    "iq3_m": (F.MOSTLY_IQ3_M, Q.IQ3_S), "iq3_s": (F.MOSTLY_IQ3_S, Q.IQ3_S), "iq3_xs": (F.MOSTLY_IQ3_XS, Q.IQ3_S),
    "iq3_xxs": (F.MOSTLY_IQ3_XXS, Q.IQ3_XXS), "iq2_m": (F.MOSTLY_IQ2_M, Q.IQ2_S),
    "iq2_s": (F.MOSTLY_IQ2_S, Q.IQ2_XS),  # sic: llama.cpp's IQ2_S file is mostly IQ2_XS, its IQ2_M file IQ2_S
    "iq2_xs": (F.MOSTLY_IQ2_XS, Q.IQ2_XS), "iq2_xxs": (F.MOSTLY_IQ2_XXS, Q.IQ2_XXS), "iq1_s": (F.MOSTLY_IQ1_S, Q.IQ1_S),
    "iq1_m": (F.MOSTLY_IQ1_M, Q.IQ1_M),
}
_IQ4 = ("iq4_nl", "iq4_xs")
_IQ2 = ("iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m")  # llama.cpp's very-low-bit branch of its rules
_IQ3 = ("iq3_xxs", "iq3_xs", "iq3_s", "iq3_m")
# llama.cpp's fallback where a row is not a whole number of the type's blocks
_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL,
             **dict.fromkeys((Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ1_M), Q.IQ4_NL)}
# the types llama.cpp's quantizer writes only with an importance matrix (tensor_requires_imatrix),
# but for the embedding table and the output head
_IMATRIX_TYPES = (Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ1_M)
# (and, as llama.cpp's quantizer, the convolutions of Mamba2, Gated DeltaNet and lfm2: small, kept F32)
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight", "shortconv.conv.weight")


@dataclass(frozen=True)
class ModelShape:
    """What llama.cpp's choice of types reads from the model."""

    layers: int
    heads: int
    kv_heads: int
    experts: int = 0
    architecture: str = "llama"


def _use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _category(name: str) -> str:
    """llama.cpp's tensor category (tensor_get_category): the first of these the name holds."""
    if name in ("output.weight", "token_embd.weight"):
        return name.split(".")[0]
    for part in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight", "attn_q.weight",
                 "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if part in name:
            return {"attn_qkv.weight": "attn_v", "attn_kv_b.weight": "attn_v"}.get(part, part.removesuffix(".weight"))
    return "other"


def _layer(name: str) -> int:
    match = re.match(r"blk\.(\d+)\.", name)
    return int(match.group(1)) if match else -1


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """llama.cpp's tensor_allows_quantization for the tensors hearth writes."""
    return len(shape) >= 2 and name.endswith("weight") and not name.endswith(_NOT_QUANTIZED) \
        and "ffn_gate_inp" not in name


def tensor_types(tensors: list[tuple[str, tuple[int, ...]]], mix: str, model: ModelShape,
                 has_imatrix: bool = False) -> dict[str, GGMLQuantizationType]:
    """The type llama.cpp's quantizer gives each quantizable tensor (name, shape in torch order) at
    `mix`. Counters run in llama.cpp's order: tensors outside the layers first, then by layer, by name."""
    default = MIXES[mix][1]
    tied = not any(name == "output.weight" for name, _ in tensors)
    n_attn_v = sum(_category(name) == "attn_v" for name, _ in tensors)
    seen_attn_v = seen_ffn_down = 0
    types = {}
    for name, shape in sorted(tensors, key=lambda t: (_layer(t[0]), t[0])):
        if not quantizable(name, shape):
            continue
        category = _category(name)
        layer = _layer(name) if model.experts > 1 or category != "ffn_down" else seen_ffn_down
        qtype = _mix_type(mix, default, category, shape[-1], tied, model, layer, seen_attn_v, n_attn_v, has_imatrix)
        seen_attn_v += category == "attn_v"
        seen_ffn_down += category == "ffn_down"
        if shape[-1] % GGML_QUANT_SIZES[qtype][0]:
            qtype = _FALLBACK.get(qtype, qtype)
            qtype = qtype if shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16
        types[name] = qtype
    return types


def _mix_type(mix: str, qtype: GGMLQuantizationType, category: str, cols: int, tied: bool, model: ModelShape,
              layer: int, i_attn_v: int, n_attn_v: int, has_imatrix: bool) -> GGMLQuantizationType:
    """llama_tensor_get_type_impl for the mixes above (no Falcon). layer: ffn_down's counter (the
    layer in a mixture of experts), the name's layer for the other categories."""
    n = model.layers
    gqa = model.heads // max(1, model.kv_heads)
    if category == "output" or (tied and category == "token_embd"):
        if cols % GGML_QUANT_SIZES[qtype][0]:
            return Q.Q8_0
        if mix in (*_IQ2, "iq3_xxs"):
            return Q.Q5_K
        return qtype if qtype == Q.Q8_0 else Q.Q6_K
    if category == "token_embd":
        return {"iq2_xxs": Q.Q2_K, "iq2_xs": Q.Q2_K, "iq1_s": Q.Q2_K, "iq1_m": Q.Q2_K, "iq2_s": Q.IQ3_S,
                "iq2_m": Q.IQ3_S, "iq3_xxs": Q.IQ3_S}.get(mix, qtype)
    if mix in _IQ2:
        return _iq2_type(mix, qtype, category, model, gqa, layer)
    if category == "attn_v":
        return _attn_v_type(mix, qtype, model, gqa, i_attn_v, n_attn_v, has_imatrix)
    if category in ("attn_k", "attn_q"):
        if category == "attn_k" and model.experts == 8:
            return Q.Q8_0
        return {"iq3_xs": Q.IQ3_XXS, "iq3_xxs": Q.IQ2_S}.get(mix, qtype)
    if category == "ffn_down":
        if mix == "q2_k":
            return Q.Q3_K
        if mix == "q3_k_m":
            return Q.Q5_K if layer < n // 16 else Q.Q4_K
        if mix == "q3_k_l":
            return Q.Q5_K
        if mix in ("q4_k_m", "q5_k_m"):
            return Q.Q6_K if _use_more_bits(layer, n) else qtype
        if mix == "iq3_xxs" and not has_imatrix:
            return Q.Q4_K if layer < n // 8 else Q.Q3_K
        if mix == "iq3_m" and (layer < n // 8 or (model.experts == 8 and _use_more_bits(layer, n))):
            return Q.Q4_K
        if mix in _IQ4 and not has_imatrix and layer < n // 8:
            return Q.Q5_K
        if mix == "q4_k_s" and layer < n // 8:
            return Q.Q5_K
        if mix in ("q4_0", "q5_0") and has_imatrix and layer < n // 8:
            return Q.Q4_1 if mix == "q4_0" else Q.Q5_1
        return qtype
    if category == "attn_output":
        if model.experts == 8:
            return Q.Q5_K if mix in ("q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m", *_IQ4, *_IQ3) else qtype
        return {"q2_k": Q.Q3_K, "q3_k_m": Q.Q4_K, "q3_k_l": Q.Q5_K, "iq3_xxs": Q.IQ3_S, "iq3_m": Q.Q4_K}.get(mix, qtype)
    if category in ("ffn_gate", "ffn_up") and mix == "iq3_xs" and n // 8 <= layer < 7 * n // 8:
        return Q.IQ3_XXS
    return qtype


def _attn_v_type(mix: str, qtype: GGMLQuantizationType, model: ModelShape, gqa: int, i_attn_v: int, n_attn_v: int,
                 has_imatrix: bool) -> GGMLQuantizationType:
    """llama.cpp's attn_v rules outside its very-low-bit branch."""
    qtype = {"q2_k": Q.Q4_K if gqa >= 4 else Q.Q3_K, "q3_k_m": Q.Q5_K if i_attn_v < 2 else Q.Q4_K,
             "q3_k_l": Q.Q5_K, "iq3_m": Q.Q4_K,
             "iq3_xxs": Q.Q4_K if gqa >= 4 else Q.IQ3_XXS if has_imatrix else Q.IQ3_S}.get(mix, qtype)
    if mix in ("iq3_xs", "iq3_s") and gqa >= 4:
        qtype = Q.Q4_K
    elif mix in _IQ4 and gqa >= 4:
        qtype = Q.Q5_K
    elif mix in ("q4_k_m", "q5_k_m") and _use_more_bits(i_attn_v, n_attn_v):
        qtype = Q.Q6_K
    elif mix == "q4_k_s" and i_attn_v < 4:
        qtype = Q.Q5_K
    if model.architecture == "llama" and model.layers == 80 and model.heads != model.kv_heads and qtype in (Q.Q3_K, Q.Q4_K):
        qtype = Q.Q5_K  # llama.cpp's 70B rule
    return Q.Q8_0 if model.experts == 8 else qtype


def _iq2_type(mix: str, qtype: GGMLQuantizationType, category: str, model: ModelShape, gqa: int,
              layer: int) -> GGMLQuantizationType:
    """llama.cpp's rules for its IQ2 and IQ1 mixes (its very-low-bit branch): more bits where they pay."""
    more = Q.IQ3_S if mix in ("iq2_s", "iq2_m") else Q.Q2_K
    if category == "attn_v":
        return Q.Q4_K if gqa >= 4 or model.experts >= 4 else more
    if category == "attn_k" and model.experts == 8:
        return Q.Q4_K
    if category == "ffn_down" and layer < model.layers // 8:
        return more
    if category == "attn_output":
        if model.experts == 8:
            return Q.Q5_K
        return Q.IQ3_S if mix in ("iq2_s", "iq2_m") else Q.IQ2_XXS if mix in ("iq1_s", "iq1_m") else qtype
    return qtype


def quantize_model(source: str | Path, out_path: str | Path, mix: str, imatrix: dict[str, np.ndarray] | None = None,
                   progress: bool = True) -> Path:
    """Write the model at `source` (an HF folder, or an F32/F16/BF16 GGUF file) quantized to `mix`
    at `out_path` (returned). imatrix: llama.cpp's importance matrix by tensor name (imatrix.py)."""
    writer, plan = plan_quantization(source, mix, imatrix, progress)
    return write_gguf(writer, plan, out_path, f"quantizing to {mix}", progress, importance=imatrix)


def plan_quantization(source: str | Path, mix: str, imatrix: dict[str, np.ndarray] | None = None,
                      progress: bool = True) -> tuple[GGUFWriter, list[PlannedTensor]]:
    """The writer (the file's metadata) and every tensor of `source` with the type `mix` gives it."""
    if mix not in MIXES:
        raise ModelLoadError(f"unknown quantization type {mix!r}; choose one of {', '.join(MIXES)}")
    file_type = MIXES[mix][0]
    source = Path(source)
    if source.is_dir():
        writer, config, plan = open_hf_folder(source, file_type, Q.F16, progress)
        model = ModelShape(config.num_layers, config.num_heads, config.num_kv_heads, config.num_experts or 0,
                           GGUF_ARCHITECTURES[config.architecture])
    elif source.is_file():
        writer, model, plan = _open_gguf(source, file_type)
    else:
        raise ModelLoadError(f"{source}: no such model file or folder")
    types = tensor_types([(name, shape) for name, shape, _, _ in plan], mix, model, has_imatrix=bool(imatrix))
    _check_importance(types, mix, imatrix)
    return writer, [(name, shape, types.get(name, qtype), values) for name, shape, qtype, values in plan]


def _check_importance(types: dict[str, GGMLQuantizationType], mix: str, imatrix: dict[str, np.ndarray] | None) -> None:
    """llama.cpp's refusal: the very-low-bit i-quants only with an importance matrix for the tensor."""
    missing = [name for name, qtype in types.items() if qtype in _IMATRIX_TYPES and not (imatrix and name in imatrix)
               and name not in ("token_embd.weight", "output.weight")]
    if missing:
        what = "has no entry for" if imatrix else "needs an importance matrix (--imatrix) for"
        raise ModelLoadError(f"--type {mix} {what} {missing[0]} ({types[missing[0]].name}) and {len(missing) - 1} "
                             f"other tensors: llama.cpp's quantizer writes {', '.join(q.name for q in _IMATRIX_TYPES)} "
                             "only with one (make it with `hearth imatrix MODEL --text-file F -o imatrix.gguf`)")


def _open_gguf(path: Path, file_type: LlamaFileType) -> tuple[GGUFWriter, ModelShape, list[PlannedTensor]]:
    """A writer holding the file's metadata (its file type replaced), the model's shape, and its tensors."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    fields = {name: field for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    if arch is None:
        raise ModelLoadError(f"{path}: no general.architecture; not a model file")
    writer = GGUFWriter(None, arch)
    for name, field in fields.items():
        if name in ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment"):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), main, sub)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(GGML_QUANT_VERSION)

    def number(key: str, default: int = 0) -> int:
        value = fields[key].contents() if key in fields else default
        return int(max(value) if isinstance(value, list) else value)

    heads = number(f"{arch}.attention.head_count")
    model = ModelShape(number(f"{arch}.block_count"), heads, number(f"{arch}.attention.head_count_kv", heads),
                       number(f"{arch}.expert_count"), arch)
    plan = []
    for tensor in reader.tensors:
        if tensor.tensor_type not in (Q.F32, Q.F16, Q.BF16):
            raise ModelLoadError(f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}; hearth quantizes "
                                 "F32, F16 and BF16 files (or the Hugging Face folder), not already quantized ones")
        shape = tuple(int(d) for d in reversed(tensor.shape))
        plan.append((tensor.name, shape, tensor.tensor_type, _values(tensor.data, tensor.tensor_type, shape)))
    return writer, model, plan


def _values(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]):
    def values() -> torch.Tensor:
        if qtype == Q.BF16:
            return torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16).float().reshape(shape)
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)

    return values
