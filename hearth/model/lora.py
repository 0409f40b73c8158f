"""LoRA adapters in a loaded model: slots for several adapters at once, each row of a step on its own.

`LoraBank(model, max_loras, max_rank)` wraps, once, every projection of the decoder layers that an
adapter may target (attention's q, k, v and o, the MLP's gate, up and down) in a `LoraLinear`: the
backend's own module for the base weight (dense, or a QuantTensor's module that `Backend.prepare`
put there: Int8Linear, HalfLinear, DequantLinear) stays inside it untouched and computes y = x W^T;
the wrapper adds the adapters' low-rank terms. Each wrapper holds `max_loras` slots of A [R, in] and
B [out, R] (R = max_rank; an adapter of lower rank is zero-padded, which adds exact zeros), both
transposed: A^T [slots, in, R x projections], B^T [slots, R, out] (so that the kernels multiply-add
a vector of columns at a time). A merged projection (hearth's qkv_proj and gate_up_proj parts:
MergedLinear) lays the A^T and the B^T of each projection it holds side by side ([q | k | v]
columns), each output column taking its own projection's R columns of A x.

A step's rows each name a slot or none (`LoraBank.activate`, from the runner). The rows of one slot
go together, each slot's matrices read once for them (punica's shrink then expand): the modules take
x [rows, in] @ A_s^T -> [rows, R x projections], then each projection's columns @ its columns of B_s^T,
scaled and added to the base's output at those rows; the cpu backend's whole-layer decode kernels do
the same in C++ after each matmul (hearth/backend/cpu_decode.py, cpu_kernels/lora.cpp). The slots no
row uses are not read; a step with no adapter adds nothing.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hearth.errors import ModelLoadError
from hearth.model.layers import GatedMLP, MergedLinear

# the projections an adapter may target, by their checkpoint names
ADAPTABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraRows:
    """A step's adapters, shared by every LoraLinear of a model (and read by the cpu backend's decode kernels)."""

    def __init__(self, slots: int, rank: int):
        self.rank = rank  # R, every slot's (lower ranks zero-padded)
        self.active = False  # some row of the step has an adapter
        self.row_slots = np.empty(0, dtype=np.int32)  # [T] each row's slot, -1: none (while active)
        self.slot_scales = np.zeros(slots, dtype=np.float32)  # [slots] each loaded adapter's scale
        # (slot, its rows [k] on the model's device or None: every row of the step, its scale) per slot in use
        self.groups: list[tuple[int, torch.Tensor | None, float]] = []


class LoraLinear(nn.Module):
    """The base module's y = x W^T plus the step's adapters' terms (see the module's docstring).
    `out_sizes`: the projections the base computes side by side (one, or a merged group's)."""

    def __init__(self, base: nn.Module, in_features: int, out_sizes: list[int], rows: LoraRows, slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.lora_base, self.rows, self.max_rank = base, rows, max_rank
        self.in_features, self.out_sizes = in_features, out_sizes
        self.register_buffer("lora_a", torch.zeros(slots, in_features, max_rank * len(out_sizes), dtype=dtype,
                                                   device=device), persistent=False)  # [slots, in, R x projections]: A^T
        self.register_buffer("lora_b", torch.zeros(slots, max_rank, sum(out_sizes), dtype=dtype, device=device),
                             persistent=False)  # [slots, R, out]: B^T

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = self.lora_base(x)
        for slot, rows, scale in self.rows.groups:
            if rows is None:
                y.add_(self._low_rank(x, slot), alpha=scale)
            else:
                y.index_add_(0, rows, self._low_rank(x.index_select(0, rows), slot), alpha=scale)
        return y

    def _low_rank(self, x: torch.Tensor, slot: int) -> torch.Tensor:  # [k, in] -> [k, out]: B_s (A_s x), unscaled
        xa = x @ self.lora_a[slot].to(x.dtype)  # [k, R x projections]
        if len(self.out_sizes) == 1:
            return xa @ self.lora_b[slot].to(x.dtype)
        b = self.lora_b[slot].to(x.dtype).split(self.out_sizes, dim=1)
        return torch.cat([xa_p @ b_p for xa_p, b_p in zip(xa.split(self.max_rank, dim=1), b)], dim=1)

    def put(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Projection `part`'s A [r, in] and B [out_sizes[part], r] into the slot (r <= max_rank)."""
        columns = slice(part * self.max_rank, part * self.max_rank + a.shape[0])
        start = sum(self.out_sizes[:part])
        self.lora_a[slot, :, columns] = a.T.to(self.lora_a.dtype)
        self.lora_b[slot, : b.shape[1], start : start + b.shape[0]] = b.T.to(self.lora_b.dtype)


class LoraBank:
    """Every adaptable projection of `model` wrapped (LoraLinear), and its slots filled and emptied."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype | None = None):
        """dtype: the matrices' (None: the model's)."""
        self.max_loras, self.max_rank = max_loras, max_rank
        self.rows = LoraRows(max_loras, max_rank)
        # PEFT's module path without "model." (layers.0.self_attn.q_proj) -> (wrapper, projection in it)
        self.targets: dict[str, tuple[LoraLinear, int]] = {}
        model.lora_rows = self.rows
        dtype, device = dtype or model.dtype, model.norm.weight.device
        for i, layer in enumerate(model.layers):
            modules = [(f"layers.{i}.self_attn", layer.self_attn, ("qkv_proj", "o_proj"))]
            if isinstance(layer.mlp, GatedMLP):  # (not a mixture of experts: its experts are not adaptable)
                modules.append((f"layers.{i}.mlp", layer.mlp, ("gate_up_proj", "down_proj")))
            for prefix, parent, names in modules:
                for name in names:
                    if hasattr(parent, name):
                        self._wrap(prefix, parent, name, dtype, device)
        model.backend_state.clear()  # what the backend derived from the modules (its decode path) sees the wrappers

    def _wrap(self, prefix: str, parent: nn.Module, name: str, dtype: torch.dtype, device: torch.device) -> None:
        module = getattr(parent, name)
        if not isinstance(module, MergedLinear):
            in_features = getattr(module, "in_features", None) or module.weight.shape[1]
            out_features = getattr(module, "out_features", None) or module.weight.shape[0]
            wrapper = LoraLinear(module, in_features, [out_features], self.rows, self.max_loras, self.max_rank,
                                 dtype, device)
            setattr(parent, name, wrapper)
            self.targets[f"{prefix}.{name}"] = (wrapper, 0)
            return
        part_names = iter(module.part_names)
        for g, sizes in enumerate(module.groups):  # one wrapper per stored part: its projections side by side
            wrapper = LoraLinear(module.parts[g], module.in_features, sizes, self.rows, self.max_loras,
                                 self.max_rank, dtype, device)
            module.parts[g] = wrapper
            for j in range(len(sizes)):
                self.targets[f"{prefix}.{next(part_names)}"] = (wrapper, j)

    def check(self, adapter) -> list[tuple[LoraLinear, int, torch.Tensor, torch.Tensor]]:
        """Where each of the adapter's (loading/lora.py's LoraAdapter) matrices go; ModelLoadError for a
        module the model has no adaptable projection for, a shape that does not fit, a rank too high."""
        if adapter.rank > self.max_rank:
            raise ModelLoadError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} is above this engine's "
                                 f"max_lora_rank {self.max_rank} (--max-lora-rank)")
        placed = []
        for module, (a, b) in adapter.weights.items():
            target = self.targets.get(module.removeprefix("model."))
            if target is None:
                raise ModelLoadError(f"LoRA adapter {adapter.name!r}: target module {module} is not one hearth "
                                     f"adapts (the decoder layers' {', '.join(ADAPTABLE)}; not in a mixture of "
                                     "experts)")
            wrapper, part = target
            expected = ((adapter.rank, wrapper.in_features), (wrapper.out_sizes[part], adapter.rank))
            if (tuple(a.shape), tuple(b.shape)) != expected:
                raise ModelLoadError(f"LoRA adapter {adapter.name!r}: {module}: lora_A {tuple(a.shape)} and lora_B "
                                     f"{tuple(b.shape)}, expected {expected[0]} and {expected[1]} for this model")
            placed.append((wrapper, part, a, b))
        return placed

    def load(self, slot: int, adapter) -> None:
        """The adapter into `slot` (checked first: a refused adapter changes nothing)."""
        placed = self.check(adapter)
        self.clear(slot)
        for wrapper, part, a, b in placed:
            wrapper.put(slot, part, a, b)
        self.rows.slot_scales[slot] = adapter.scale

    def clear(self, slot: int) -> None:
        for wrapper in {id(w): w for w, _ in self.targets.values()}.values():
            wrapper.lora_a[slot].zero_()
            wrapper.lora_b[slot].zero_()
        self.rows.slot_scales[slot] = 0.0

    def activate(self, row_slots: np.ndarray | None) -> None:
        """The next passes' rows' slots (int [T], -1: the base model alone; None: every row so)."""
        rows = self.rows
        rows.groups = []
        rows.active = row_slots is not None and bool((row_slots >= 0).any())
        if not rows.active:
            return
        rows.row_slots = np.ascontiguousarray(row_slots, dtype=np.int32)
        for slot in np.unique(rows.row_slots[rows.row_slots >= 0]).tolist():
            mine = rows.row_slots == slot
            index = None if mine.all() else torch.from_numpy(np.flatnonzero(mine)).to(self.device)
            rows.groups.append((slot, index, float(rows.slot_scales[slot])))

    @property
    def device(self) -> torch.device:
        return next(iter(self.targets.values()))[0].lora_a.device
