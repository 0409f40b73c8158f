"""LoRA adapters in a loaded model: slots for several adapters at once, each row of a step on its own.

`LoraBank(model, max_loras, max_rank)` wraps, once, every projection of the decoder layers that an
adapter may target (attention's q, k, v and o, the MLP's gate, up and down) in a `LoraLinear`: the
backend's own module for the base weight (dense, or a QuantTensor's module that `Backend.prepare`
put there: Int8Linear, HalfLinear, DequantLinear) stays inside it untouched and computes y = x W^T;
the wrapper adds the adapters' low-rank terms. Each wrapper holds `max_loras` slots of A [R, in] and
B [out, R] (R = max_rank; an adapter of lower rank is zero-padded, which adds exact zeros), laid out
so that all slots' together are one matrix with no copy: A [slots x R, in], B [out, slots x R]. A
merged projection (hearth's qkv_proj and gate_up_proj parts: MergedLinear) stacks the A of each
projection it holds ([q; k; v] rows, R each) and lays their B out block-diagonally, so that one
pair of matmuls serves them all and each output column sees only its own projection's adapter.

A step's rows each name a slot or none (`LoraBank.activate`, from the runner). The low-rank term
is then computed for every slot together: x [T, in] @ A^T -> [T, slots x R], each row's columns of
adapters other than its own zeroed and its own scaled by its adapter's scale, then @ B^T -> [T, out],
added to the base's output (a batched low-rank matmul by masking: two small matmuls per projection
whatever the mix, no gathering of matrices; empty slots cost their columns). A step whose rows all
use one adapter takes that slot's matrices alone (no mask); a step with none adds nothing.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hearth.errors import ModelLoadError
from hearth.model.layers import GatedMLP, MergedLinear

# the projections an adapter may target, by their checkpoint names
ADAPTABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraRows:
    """A step's adapters, shared by every LoraLinear of a model: which slots it uses and each row's."""

    def __init__(self) -> None:
        self.active = False  # some row of the step has an adapter
        self.single: tuple[int, float] | None = None  # (slot, scale) when every row uses that one
        self.row_scales: torch.Tensor | None = None  # [T, slots] a row's scale at its slot's column, else 0

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """y [T, out] + the low-rank terms of x [T, in], a [slots, R', in], b [out, slots, R']."""
        if self.single is not None:
            slot, scale = self.single
            return y.add_(F.linear(F.linear(x, a[slot]), b[:, slot]), alpha=scale)
        slots, rank = a.shape[:2]
        xa = F.linear(x, a.flatten(0, 1)).view(-1, slots, rank) * self.row_scales[:, :, None]
        return y.add_(F.linear(xa.flatten(1), b.flatten(1)))


class LoraLinear(nn.Module):
    """The base module's y = x W^T plus the step's adapters' terms (see the module's docstring).
    `out_sizes`: the projections the base computes side by side (one, or a merged group's)."""

    def __init__(self, base: nn.Module, in_features: int, out_sizes: list[int], rows: LoraRows, slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.lora_base, self.rows, self.max_rank = base, rows, max_rank
        self.in_features, self.out_sizes = in_features, out_sizes
        width = max_rank * len(out_sizes)
        self.register_buffer("lora_a", torch.zeros(slots, width, in_features, dtype=dtype, device=device),
                             persistent=False)  # [slots, R x projections, in]
        self.register_buffer("lora_b", torch.zeros(sum(out_sizes), slots, width, dtype=dtype, device=device),
                             persistent=False)  # [out, slots, R x projections], block-diagonal per slot

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = self.lora_base(x)
        return self.rows.add_delta(y, x, self.lora_a, self.lora_b) if self.rows.active else y

    def put(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Projection `part`'s A [r, in] and B [out_sizes[part], r] into the slot (r <= max_rank)."""
        columns = slice(part * self.max_rank, part * self.max_rank + a.shape[0])
        start = sum(self.out_sizes[:part])
        self.lora_a[slot, columns] = a.to(self.lora_a.dtype)
        self.lora_b[start : start + b.shape[0], slot, columns] = b.to(self.lora_b.dtype)


class LoraBank:
    """Every adaptable projection of `model` wrapped (LoraLinear), and its slots filled and emptied."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.rows = LoraRows()
        self.scales = [0.0] * max_loras
        # PEFT's module path without "model." (layers.0.self_attn.q_proj) -> (wrapper, projection in it)
        self.targets: dict[str, tuple[LoraLinear, int]] = {}
        model.lora_rows = self.rows
        dtype, device = model.dtype, model.norm.weight.device
        for i, layer in enumerate(model.layers):
            modules = [(f"layers.{i}.self_attn", layer.self_attn, ("qkv_proj", "o_proj"))]
            if isinstance(layer.mlp, GatedMLP):  # (not a mixture of experts: its experts are not adaptable)
                modules.append((f"layers.{i}.mlp", layer.mlp, ("gate_up_proj", "down_proj")))
            for prefix, parent, names in modules:
                for name in names:
                    if hasattr(parent, name):
                        self._wrap(prefix, parent, name, dtype, device)

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
        self.scales[slot] = adapter.scale

    def clear(self, slot: int) -> None:
        for wrapper in {id(w): w for w, _ in self.targets.values()}.values():
            wrapper.lora_a[slot].zero_()
            wrapper.lora_b[:, slot].zero_()
        self.scales[slot] = 0.0

    def activate(self, row_slots: np.ndarray | None) -> None:
        """The next passes' rows' slots (int [T], -1: the base model alone; None: every row so)."""
        rows = self.rows
        used = np.unique(row_slots[row_slots >= 0]) if row_slots is not None else np.empty(0, dtype=np.int64)
        rows.single = rows.row_scales = None
        rows.active = bool(len(used))
        if not rows.active:
            return
        if len(used) == 1 and (row_slots == used[0]).all():
            rows.single = (int(used[0]), self.scales[int(used[0])])
            return
        scales = np.array(self.scales, dtype=np.float32)
        weights = (row_slots[:, None] == np.arange(self.max_loras)[None, :]) * scales[None, :]  # [T, slots]
        rows.row_scales = torch.from_numpy(weights.astype(np.float32)).to(self.device, self.dtype)

    @property
    def device(self) -> torch.device:
        return next(iter(self.targets.values()))[0].lora_a.device

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.targets.values()))[0].lora_a.dtype
