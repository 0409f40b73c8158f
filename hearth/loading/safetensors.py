"""Read a Hugging Face model folder: config.json and (sharded) safetensors, memory-mapped."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hearth.config import ModelConfig
from hearth.errors import ModelLoadError
from hearth.loading.gpt_oss import split_fused_experts
from hearth.loading.names import (MTP_ARCHITECTURES, NOT_LOADED, NOT_LOADED_WITH_VISION, checkpoint_tensors,
                                  mtp_layer_count)
from hearth.quant.tensor import QuantTensor

logger = logging.getLogger("hearth")


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no 'weight_map' object")
        names = list(weight_map.values())
        if not all(isinstance(name, str) and name and Path(name).name == name for name in names):
            raise ModelLoadError(f"{index}: 'weight_map' must name shard files inside the folder")
        files = [folder / name for name in sorted(set(names))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index}: shard files missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise ModelLoadError(f"{folder}: no weights (model.safetensors or model.safetensors.index.json)")


def load_hf_folder(folder: str | Path, progress: bool = True
                   ) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantTensor]]:
    from tqdm import tqdm

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"{folder}: no config.json")
    hf = read_json(config_path)
    config = ModelConfig.from_hf(hf, str(config_path))
    weights: dict[str, torch.Tensor] = {}
    files = weight_files(folder)
    not_loaded, skipped = (NOT_LOADED_WITH_VISION if config.vision else NOT_LOADED).get(config.architecture), 0
    with tqdm(total=len(files), desc="loading", unit="file", disable=not progress, leave=False) as bar:
        for file in files:
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        if not_loaded is not None and not_loaded.match(name):
                            skipped += 1
                            continue
                        weights.update(checkpoint_tensors(config, name, f.get_tensor(name)))
            except ModelLoadError:
                raise
            except Exception as e:  # safetensors raises its own SafetensorError on damaged files
                raise ModelLoadError(f"{file}: damaged safetensors file ({e})") from None
            bar.update()
    if skipped:
        logger.warning("%s: %d tensors not loaded (%s): parts of a %s checkpoint hearth does not run", folder, skipped,
                    not_loaded.pattern, config.architecture)
    if config.architecture in MTP_ARCHITECTURES:  # its multi-token-prediction layers (mtp.*), where it ships them
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
        config.mtp_layers = mtp_layer_count(list(weights), text.get("mtp_num_hidden_layers"),
                                            text.get("mtp_use_dedicated_embeddings"), str(config_path))
    if config.architecture == "gpt_oss":  # (its quantization_config: MXFP4 experts, read here)
        weights = split_fused_experts(weights)
    elif hf.get("quantization_config") is not None:  # a library's packed weights (refused by from_hf if unread)
        from hearth.loading.library_quant import read_library_weights

        weights = read_library_weights(weights, hf["quantization_config"], str(config_path))
    return config, weights
