"""The roofline: which bound (memory bandwidth or FLOP/s) caps a step, and at how many tokens/s.

A step of the engine reads every weight once (whatever the batch), reads and writes the KV
cache of its sequences, and does about 2 FLOPs per weight per token plus attention. Its
arithmetic intensity (FLOPs per byte) against the machine's ridge point (peak FLOP/s over
bandwidth) says which bound applies; the ceiling is tokens / max(FLOPs / peak, bytes / bandwidth).

Counted per step (B sequences, each with C tokens cached and n new tokens; T = B x n):
  weights   every tensor but the embedding table (the tied lm_head reads it whole), plus T
            embedding rows; 2 FLOPs per layer weight per token, 2 x vocab x hidden per sequence
            for the lm_head (only each sequence's last token gets logits)
  attention useful causal FLOPs: 4 x heads x head_dim x layers x (n x C + n (n + 1) / 2)
  KV cache  B x (C + 2n) x kv_bytes_per_token: the context read once, the new entries written
Activations are not counted (they stay in cache at these sizes).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from hearth.config import ModelConfig


@dataclass
class Machine:
    device: str
    threads: int
    dtype: str  # the matmul that gave `flops` (the fastest measured)
    bandwidth: float  # bytes/s, reading a large tensor
    flops: float  # FLOP/s (or int8 OP/s), the fastest square matmul measured: the compute roof
    flops_by_dtype: dict[str, float] = field(default_factory=dict)

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the memory roof meets the compute roof."""
        return self.flops / self.bandwidth


@dataclass
class WeightBytes:
    """What a step reads of the weights."""

    per_step: int  # bytes read once per step: every tensor but the embedding table (tied lm_head: the table)
    embedding_row: float  # bytes of one embedding row (read once per token)
    matmul_params: int  # elements of the layers' 2-D weights (2 FLOPs each per token)


@dataclass
class StepCost:
    phase: str  # prefill or decode
    batch_size: int
    context: int  # tokens cached per sequence before the step
    new_tokens: int  # per sequence
    tokens: int  # B x new_tokens
    flops: float
    weight_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats + 1):  # the first pass warms up
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                    bandwidth_bytes: int | None = None, matmul_n: int | None = None, repeats: int = 5) -> Machine:
    """Best of several tries: the sum of a tensor far larger than the caches (bandwidth), and n x n
    matmuls in `dtype`, bfloat16 and int8 (torch._int_mm, where it runs): the compute roof is the
    fastest of them, since quantized kernels (int8 dot products) and bf16 reach past fp32."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    bandwidth_bytes = bandwidth_bytes or (4 << 30 if cuda else 512 << 20)
    matmul_n = matmul_n or (8192 if cuda else 2048)
    x = torch.ones(bandwidth_bytes // 4, dtype=torch.float32, device=device)
    bandwidth = x.numel() * 4 / _best_time(x.sum, device, 4 * repeats)  # cheap: more tries at a quiet moment
    del x
    kinds = [str(kind).removeprefix("torch.") for kind in dict.fromkeys((dtype, torch.bfloat16, torch.int8))]

    def rate(kind: str, n: int, tries: int) -> float:
        a, b = (torch.randn(n, n, device=device).to(getattr(torch, kind)) for _ in range(2))
        matmul = torch._int_mm if kind == "int8" else torch.matmul
        try:
            return 2 * n**3 / _best_time(lambda: matmul(a, b), device, tries)
        except (RuntimeError, AttributeError):  # no int8 matmul on this device or build
            return 0.0

    # n doubles from 256 to matmul_n while one product takes under half a second: a kind this
    # machine runs slowly (bf16 without AVX-512 BF16) is measured small instead of for minutes
    flops = {}
    for kind in kinds:
        n = 256
        while (measured := rate(kind, n, max(2, repeats // 2))) and n < matmul_n and 2 * n**3 / measured < 0.5:
            n *= 2
        if measured:
            flops[kind] = measured
    best = max(flops, key=flops.get)
    return Machine(str(device), torch.get_num_threads(), best, bandwidth, flops[best], flops)


def _nbytes(weight) -> int:
    """A tensor's or a QuantTensor's bytes."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return int(weight.nbytes)


def file_weight_bytes(config: ModelConfig, weights: dict) -> WeightBytes:
    """Weight bytes as stored in the file (QuantTensor blocks, f16...), by HF name."""
    embed = weights["model.embed_tokens.weight"]
    per_step = sum(_nbytes(w) for name, w in weights.items() if name != "model.embed_tokens.weight")
    if "lm_head.weight" not in weights:
        per_step += _nbytes(embed)  # tied: the output projection reads the embedding table
    matmul = sum(math.prod(tuple(w.shape)) for name, w in weights.items()
                 if ".layers." in f".{name}" and len(tuple(w.shape)) == 2)
    return WeightBytes(per_step, _nbytes(embed) / config.vocab_size, matmul)


def model_weight_bytes(model: torch.nn.Module) -> WeightBytes:
    """Weight bytes as the loaded model holds them (dense tensors, or quantized modules' buffers):
    every parameter and buffer once, less the embedding table (unless the lm_head shares it) and
    the RoPE tables."""
    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    config = model.config
    embedding = list(model.embed_tokens.parameters()) + list(model.embed_tokens.buffers())
    seen: set[tuple[int, int]] = set()
    per_step = 0
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        key = (t.data_ptr(), size(t))
        if name.startswith(("rope.", "embed_tokens.")) or t.device.type == "meta" or key in seen:
            continue  # a tied lm_head still counts the table, under its own name
        seen.add(key)
        per_step += size(t)
    matmul = 0
    for name, module in model.named_modules():
        if not name.startswith("layers."):
            continue
        weight = getattr(module, "weight", None)
        if hasattr(module, "in_features") and hasattr(module, "out_features"):  # a quantized linear
            matmul += module.in_features * module.out_features
        elif isinstance(weight, torch.Tensor) and weight.dim() == 2:
            matmul += weight.numel()
    return WeightBytes(per_step, sum(size(t) for t in embedding) / config.vocab_size, matmul)


def step_cost(config: ModelConfig, weights: WeightBytes, phase: str, batch_size: int, context: int,
              kv_bytes_per_element: int) -> StepCost:
    """Bytes and FLOPs of one step. prefill: B prompts of `context` tokens from an empty cache;
    decode: one new token for each of B sequences with `context` tokens cached."""
    if phase == "prefill":
        cached, new = 0, context
    elif phase == "decode":
        cached, new = context, 1
    else:
        raise ValueError(f"phase must be prefill or decode, got {phase!r}")
    tokens = batch_size * new
    lm_head = 2 * config.vocab_size * config.hidden_size * batch_size
    attention_pairs = new * cached + new * (new + 1) / 2  # (query, key) pairs per sequence, causal
    attention = 4 * config.num_heads * config.head_dim * config.num_layers * attention_pairs * batch_size
    flops = 2 * weights.matmul_params * tokens + lm_head + attention
    weight_bytes = weights.per_step + weights.embedding_row * tokens
    kv_bytes = batch_size * (cached + 2 * new) * config.kv_bytes_per_token(kv_bytes_per_element)
    return StepCost(phase, batch_size, cached, new, tokens, float(flops), float(weight_bytes), float(kv_bytes))


def roofline_row(cost: StepCost, machine: Machine) -> dict:
    compute_s = cost.flops / machine.flops
    memory_s = cost.bytes / machine.bandwidth
    return {
        "phase": cost.phase,
        "batch_size": cost.batch_size,
        "context": cost.context if cost.phase == "decode" else cost.new_tokens,
        "tokens_per_step": cost.tokens,
        "flops_per_step": cost.flops,
        "bytes_per_step": cost.bytes,
        "weight_bytes_per_step": cost.weight_bytes,
        "kv_bytes_per_step": cost.kv_bytes,
        "arithmetic_intensity": cost.intensity,
        "bound": "compute" if cost.intensity >= machine.ridge else "memory",
        "ceiling_tokens_per_s": cost.tokens / max(compute_s, memory_s),
    }


def roofline_table(config: ModelConfig, weights: WeightBytes, machine: Machine, batch_sizes: list[int],
                   context: int, kv_bytes_per_element: int) -> list[dict]:
    rows = []
    for phase in ("prefill", "decode"):
        for b in batch_sizes:
            rows.append(roofline_row(step_cost(config, weights, phase, b, context, kv_bytes_per_element), machine))
    return rows


def machine_dict(machine: Machine) -> dict:
    return {**asdict(machine), "ridge_flops_per_byte": machine.ridge}
