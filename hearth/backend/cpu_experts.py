"""A mixture-of-experts layer's chosen experts in two kernel calls: the CPU path for int8-kernel weights.

SparseMoE (hearth/model/layers.py) groups a step's (token, choice) pairs by expert. Run expert by
expert, a decode step at batch 1 makes 16 matmul calls per layer (Qwen3-30B-A3B: 8 experts, gate/up
and down) on weights of 1.5-3 MB, each with its Python call and, with several threads, its fork
and join. Where every expert's gate/up and down projections are each one
Int8Linear (any GGUF block format, in place or packed; hearth/backend/cpu_linear.py),
`GroupedExperts` runs the gate/up projections of all chosen experts in one call of hearth/quant/kernels'
`grouped_int8_matmul`, the activation over all rows at once, and the down projections in a second
call: the threads share out the chosen experts' weights end to end. Each expert's weights are still
read once per step, for all the rows that chose it.
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.backend.cpu_decode import on_int8_kernel
from hearth.backend.cpu_linear import Int8Linear
from hearth.quant import kernels as quant_kernels


def expert_table(projections: list[Int8Linear]) -> torch.Tensor:
    """int64 [E, 3]: each expert's weight pointer, packed scales pointer or 0, qtype
    (grouped_int8_matmul's table; pointers fixed until the tensors move)."""
    return torch.tensor([list(p.kernel_weight) for p in projections], dtype=torch.int64)


class GroupedExperts:
    """The chosen experts of one layer, gate/up in one kernel call and down in another."""

    def __init__(self, experts: nn.ModuleList, kernel):
        first = experts[0]
        self.kernel = kernel  # hearth/quant/kernels' grouped_int8_matmul
        self.ops, self.activation = first.ops, first.activation
        self.hidden, self.inter = first.down_proj.out_features, first.down_proj.in_features
        self.gate_up = expert_table([e.gate_up_proj.parts[0] for e in experts])  # [E, 3]
        self.down = expert_table([e.down_proj for e in experts])

    @classmethod
    def bind(cls, experts: nn.ModuleList) -> GroupedExperts | None:
        """The grouped path for these experts (GatedMLPs), or None where it does not apply (ungated MLPs): each
        projection must be one Int8Linear, without bias, all of one shape, the activation a plain one."""
        qmatmul = quant_kernels.extension()
        if qmatmul is None or not hasattr(experts[0], "gate_up_proj") or experts[0].clamped_swiglu is not None:
            return None  # (no gate_up_proj: an ungated MLP, nemotron_h's)

        shapes = set()
        for expert in experts:
            parts = expert.gate_up_proj.parts
            if len(parts) != 1 or not (on_int8_kernel(parts[0]) and on_int8_kernel(expert.down_proj)):
                return None
            shapes.add((parts[0].in_features, parts[0].out_features, expert.down_proj.in_features,
                        expert.down_proj.out_features))
        if len(shapes) != 1:
            return None
        return cls(experts, qmatmul.module.grouped_int8_matmul)

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x float32 [P, hidden], rows grouped by expert (counts int64 [E]: rows of each, in order)
        -> [P, hidden], each row through its expert."""
        x, counts = x.contiguous(), counts.contiguous()
        threads = torch.get_num_threads()
        experts = self.gate_up.shape[0]
        gate_up = torch.empty(x.shape[0], 2 * self.inter)
        self.kernel(x.data_ptr(), self.gate_up.data_ptr(), counts.data_ptr(), experts, gate_up.data_ptr(),
                    2 * self.inter, self.hidden, threads)
        act = self.ops.act_and_mul(gate_up[:, : self.inter], gate_up[:, self.inter :], self.activation).contiguous()
        out = torch.empty(x.shape[0], self.hidden)
        self.kernel(act.data_ptr(), self.down.data_ptr(), counts.data_ptr(), experts, out.data_ptr(),
                    self.hidden, self.inter, threads)
        return out
