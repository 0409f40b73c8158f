"""A mixture-of-experts layer's chosen experts in one kernel call per projection
(hearth/backend/cpu_experts.py, hearth/quant/kernels/grouped_experts.cpp's grouped_int8_matmul): each expert's rows against
gguf's dequantizer and a float64 matmul, and whole MoE models on the CPU backend against
transformers on the GGUF file's dequantized weights."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hearth.backend.cpu_experts import GroupedExperts, expert_table
from hearth.backend.cpu_linear import cpu_linear
from hearth.model.layers import SparseMoE
from hearth.quant import QuantTensor
from test_quant_linear import activation_block, assert_within, dense, ext, q8_tolerance, random_weight  # noqa: F401

# packed tiles on VNNI builds (every format but TQ2_0; in place elsewhere), ternary in place
QTYPES = [Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.Q4_K, Q.Q6_K, Q.TQ2_0]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_grouped_matmul_equals_each_expert_dequantized(ext, qtype):
    """Rows grouped by expert, some experts with none: every group against gguf's dequantizer and
    a float64 matmul of its own expert. 70 weight rows (no whole number of 32-row tiles); 1 thread
    (one piece per expert) and 3 and 8 (pieces of experts, ranges crossing from one expert into the
    next); decode-like counts (one row each) and a prefill's (from 24 rows: tiles decoded per call)."""
    g = torch.Generator().manual_seed(int(qtype))
    n, k, experts = 70, 512, 6
    data = [random_weight(qtype, n, k, g) for _ in range(experts)]
    layers = [cpu_linear(QuantTensor(d.reshape(-1), qtype, (n, k))) for d in data]
    table = expert_table(layers)
    weights = [dense(d, qtype, k).double() for d in data]
    for counts in ([1, 0, 1, 1, 0, 1], [3, 0, 0, 30, 1, 2]):
        counts = torch.tensor(counts, dtype=torch.int64)
        x = torch.randn(int(counts.sum()), k, generator=g)
        starts = [0, *counts.cumsum(0).tolist()]
        for threads in (1, 3, 8):
            y = torch.full((x.shape[0], n), float("nan"))  # a piece left out stays NaN
            ext.module.grouped_int8_matmul(x.data_ptr(), table.data_ptr(), counts.data_ptr(), experts, y.data_ptr(),
                                           n, k, threads)
            for e in range(experts):
                rows = slice(starts[e], starts[e + 1])
                if counts[e]:
                    assert_within(y[rows], x[rows].double() @ weights[e].T,
                                  q8_tolerance(x[rows], weights[e].float(), activation_block(qtype)))


def test_grouped_path_taken_only_where_every_expert_is_on_the_int8_kernel():
    """Q8_0 experts bind the grouped path; float experts (no int8 kernel) do not."""
    from hearth.backend.cpu import CpuBackend
    from hearth.config import ModelConfig
    from hearth.model.transformer import Transformer
    from hearth.quant import quantize

    config = ModelConfig("qwen3_moe", vocab_size=64, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                         intermediate_size=128, num_layers=1, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64,
                         qk_norm="head")
    g = torch.Generator().manual_seed(3)
    for qtype, grouped in ((Q.Q8_0, True), (None, False)):
        with torch.device("meta"):
            model = Transformer(config, backend=CpuBackend())
        weights = {}
        for name, shape in model.checkpoint_shapes():
            values = torch.randn(shape, generator=g) * 0.02
            quantized = qtype is not None and ".experts." in name
            weights[name] = QuantTensor(quantize(values, qtype), qtype, shape) if quantized else values
        model.load_weights(weights, torch.float32)
        model.backend.prepare(model, torch.float32)
        moe = model.layers[0].mlp
        assert isinstance(moe, SparseMoE)
        assert (GroupedExperts.bind(moe.experts) is not None) == grouped
