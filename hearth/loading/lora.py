"""PEFT LoRA adapters read from disk: adapter_config.json and adapter_model.safetensors.

A LoRA adapter adds to a linear projection y = x W^T the low-rank term scale * (x A^T) B^T, with
A [r, in_features] and B [out_features, r] (Hu et al., 2021); scale is lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora (Kalajdzievski, 2023). What hearth implements of PEFT's
LoraConfig: target_modules, r, lora_alpha, use_rslora. Everything else that changes the
computation is refused by name (DoRA, modules_to_save, a trained bias, per-module ranks or
alphas, ...), never ignored. Which of the model's modules the matrices fit is the model's
business (hearth/model/lora.py): here only the files are read and checked against themselves.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hearth.errors import ModelLoadError
from hearth.loading.safetensors import read_json

# PEFT's saved names: base_model.model.<module path>.lora_A.weight (the adapter's own name removed)
_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
# LoraConfig fields that change the computation, refused unless off: (field, value that means off)
_REFUSED = (("use_dora", False), ("modules_to_save", None), ("bias", "none"), ("rank_pattern", {}),
            ("alpha_pattern", {}), ("fan_in_fan_out", False), ("lora_bias", False), ("target_parameters", None),
            ("trainable_token_indices", None), ("use_qalora", False), ("alora_invocation_tokens", None))


@dataclass
class LoraAdapter:
    """One adapter's matrices by the module they adapt (PEFT's path of it, e.g.
    "model.layers.0.self_attn.q_proj"): (A [r, in_features], B [out_features, r]), float32."""

    name: str
    path: Path
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_lora_adapter(name: str, path: str | Path) -> LoraAdapter:
    """The adapter in the folder `path`; ModelLoadError naming what is wrong with it."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"LoRA adapter {name!r}: {folder} is not a folder (expected adapter_config.json and "
                             "adapter_model.safetensors in it)")
    config = read_json(folder / "adapter_config.json")
    rank, scale = _rank_and_scale(name, config)
    weights = _read_matrices(name, folder / "adapter_model.safetensors")
    for module, (a, b) in weights.items():
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ModelLoadError(f"LoRA adapter {name!r}: {module}: lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)} do not have the rank r={rank} of adapter_config.json "
                                 "(expected [r, in_features] and [out_features, r])")
    return LoraAdapter(name, folder, rank, scale, weights)


def _rank_and_scale(name: str, config: dict) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not implemented (LORA only)")
    for field, off in _REFUSED:
        value = config.get(field, off)
        if value != off and not (off is None and not value):
            raise ModelLoadError(f"LoRA adapter {name!r}: {field}={value!r} is not implemented (hearth applies "
                                 "target_modules, r, lora_alpha and use_rslora)")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ModelLoadError(f"LoRA adapter {name!r}: adapter_config.json needs an integer r >= 1 and a number "
                             f"lora_alpha (got r={rank!r}, lora_alpha={alpha!r})")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _read_matrices(name: str, file: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    if not file.exists():
        raise ModelLoadError(f"LoRA adapter {name!r}: no {file.name} in {file.parent}")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                m = _KEY.fullmatch(key)
                if m is None:
                    raise ModelLoadError(f"LoRA adapter {name!r}: tensor {key} is not a LoRA matrix hearth "
                                         "implements (expected base_model.model.<module>.lora_A/lora_B.weight)")
                halves.setdefault(m.group(1), {})[m.group(2)] = f.get_tensor(key).float()
    except SafetensorError as e:
        raise ModelLoadError(f"LoRA adapter {name!r}: {file}: not a safetensors file: {e}") from None
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ModelLoadError(f"LoRA adapter {name!r}: {module} has no {missing}.weight")
    if not halves:
        raise ModelLoadError(f"LoRA adapter {name!r}: {file.name} holds no LoRA matrices")
    return {module: (pair["A"], pair["B"]) for module, pair in halves.items()}
