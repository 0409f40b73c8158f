"""Activation sparsity's thresholds file (`hearth sparsify` writes it; --activation-thresholds reads it).

JSON. For every layer and site (hearth/model/activation_sparsity.py) the calibrated magnitude
quantiles of that input at the sparsities of GRID (0, 0.01, ..., 0.99, then the largest magnitude
seen at 1.0): one calibration serves every target sparsity, the threshold for s interpolated
linearly between the two grid points around it. The model's shape is recorded, and a file is
refused for a model of another shape (it would mask the wrong inputs by the wrong amounts).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hearth.config import ModelConfig
from hearth.engine_config import SparsityConfig
from hearth.errors import HearthError
from hearth.model.activation_sparsity import SITES, apply_activation_sparsity
from hearth.model.transformer import Transformer

FORMAT, VERSION = "hearth-activation-thresholds", 1
GRID = tuple(i / 100 for i in range(101))


def model_shape(config: ModelConfig) -> dict:
    """What a thresholds file must agree with."""
    return {"architecture": config.architecture, "num_layers": config.num_layers,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size}


@dataclass
class ActivationThresholds:
    model: dict  # model_shape of the calibrated model
    source: str  # the model's file or folder name, for messages
    tokens: int  # calibration tokens
    thresholds: dict[str, list[float]] = field(default_factory=dict)  # "layer.site" -> a threshold per GRID point

    def at(self, sparsity: float) -> dict[tuple[int, str], float]:
        """(layer, site) -> the threshold masking `sparsity` of that input's calibration activations."""
        return {(int(key.split(".")[0]), key.split(".")[1]): float(np.interp(sparsity, GRID, values))
                for key, values in self.thresholds.items()}

    def check(self, config: ModelConfig, path: str | Path) -> None:
        """HearthError where the file was calibrated on a model of another shape."""
        if self.model != model_shape(config):
            raise HearthError(f"{path}: activation thresholds of another model ({self.source}: {self.model}); this "
                              f"one is {model_shape(config)}: run `hearth sparsify` on it")
        expected = {f"{layer}.{site}" for layer in range(config.num_layers) for site in SITES}
        if set(self.thresholds) != expected or any(len(v) != len(GRID) for v in self.thresholds.values()):
            raise HearthError(f"{path}: the thresholds do not cover this model's {config.num_layers} layers x "
                              f"{len(SITES)} inputs")


def write_thresholds(path: str | Path, thresholds: ActivationThresholds) -> Path:
    path = Path(path)
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "grid": GRID, **asdict(thresholds)}) + "\n")
    return path


def read_thresholds(path: str | Path) -> ActivationThresholds:
    """The file at `path`; HearthError, saying what is wrong, for anything that is not one of these files."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise HearthError(f"{path}: cannot read the activation thresholds: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HearthError(f"{path}: not an activation thresholds file (not JSON; `hearth sparsify` writes them)") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise HearthError(f"{path}: not an activation thresholds file (`hearth sparsify` writes them)")
    if data.get("version") != VERSION or tuple(data.get("grid", ())) != GRID:
        raise HearthError(f"{path}: thresholds file version {data.get('version')}; this hearth reads {VERSION}")
    try:
        result = ActivationThresholds(dict(data["model"]), str(data["source"]), int(data["tokens"]),
                                      {str(k): [float(t) for t in v] for k, v in data["thresholds"].items()})
    except (KeyError, TypeError, ValueError, AttributeError):
        raise HearthError(f"{path}: a damaged activation thresholds file (fields missing or of the wrong type)") from None
    return result


def sparsify_model(model: Transformer, config: ModelConfig, sparsity: SparsityConfig | None) -> None:
    """Activation sparsity on the loaded model as `sparsity` asks (nothing at sparsity 0: dense, bit for bit).
    A thresholds file given is read and checked against the model either way."""
    if sparsity is None or sparsity.activation_thresholds is None:
        return
    path = sparsity.activation_thresholds
    thresholds = read_thresholds(path)
    thresholds.check(config, path)
    if sparsity.activation_sparsity > 0:
        apply_activation_sparsity(model, thresholds.at(sparsity.activation_sparsity))
