"""The GPU backend: Triton kernels for every operation, CUDA graphs for decode steps, GGUF
weights kept quantized on the device.

Attention metadata is one varlen description of the step (hearth/triton_kernels/attention.py):
sequence start offsets, context lengths, block tables, slot mapping; a step of decodes only runs the
split-KV decode kernel, any other step the paged prefill kernel (a decode being a sequence with one
query row), which also takes the rows that see other keys than causal ones (`row_masks`: Gemma 3's
images both ways, speculative token trees); attention sinks (gpt-oss) go to both kernels. Decode
steps up to the largest captured batch replay a CUDA graph (graphs.py). The KV cache may be the
compute dtype, q8_0 or fp8 e4m3 (hearth/kv_format.py): the RoPE + cache-write kernel quantizes, the
attention kernels dequantize as they load. The same code runs on a CPU under Triton's interpreter
(TRITON_INTERPRET=1), which is how the tests check it without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hearth.backend.base import Backend, DecodeSampling, StepInputs
from hearth.backend.gpu_linear import TritonQuantLinear
from hearth.config import MAX_DECODE_QUERY_LEN
from hearth.triton_kernels import activation, attention, norm, rope

FP8_CAPABILITY = (8, 9)  # the first GPUs with e4m3 conversions (Ada)


@dataclass
class GpuMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token (< 0: padding, not stored)
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S] context after this step
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    block_size: int
    max_query_len: int  # host int: the prefill kernel's grid
    num_splits: int  # split-KV parts of the decode kernel (fixed per captured graph)
    masks: attention.RowMasks | None = None  # rows that see other keys than causal ones (images, token trees)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1 and self.masks is None


class GpuBackend(Backend):
    name = "gpu"
    latent_attention = False  # its Triton kernels read whole K and V caches of one width
    state_layers = False  # no Triton kernels for convolutions and delta rules yet
    mixed_kv_layers = False  # its decode graphs and split counts assume one K/V shape, every layer its own cache

    def __init__(self, device: torch.device | str, use_cuda_graphs: bool = True, max_graph_batch: int = 256):
        super().__init__(device)
        self.use_cuda_graphs = use_cuda_graphs
        self.max_graph_batch = max_graph_batch
        self._num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                         if self.device.type == "cuda" else 132)
        # (major, minor); None under Triton's interpreter, which converts fp8 in software
        self.capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None

    def check_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """An fp8 cache needs the e4m3 conversions Triton compiles for sm_89 and newer GPUs (Ada, Hopper)."""
        if kv_cache_dtype == "fp8_e4m3" and self.capability is not None and self.capability < FP8_CAPABILITY:
            raise ValueError(f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                             f"this one is {self.capability[0]}.{self.capability[1]}: use --kv-cache-dtype q8_0 "
                             f"(about as many tokens in a budget)")

    # ---- a step ------------------------------------------------------------------------

    def forward(self, model, step: StepInputs, kv_caches):
        graphs = self._decode_graphs(model, step, kv_caches)
        return graphs.run(step) if graphs is not None else super().forward(model, step, kv_caches)

    def decode_and_sample(self, model, step: StepInputs, kv_caches, sampling: DecodeSampling):
        """The forward pass, LM head and draws of a decode step in one graph replay (graphs.py)."""
        graphs = self._decode_graphs(model, step, kv_caches)
        return None if graphs is None else graphs.run(step, sampling)

    def _decode_graphs(self, model, step: StepInputs, kv_caches):
        """The model's DecodeGraphs (made on first use) where they run this step, else None."""
        # a mixture of experts groups tokens by expert on the host (hearth/model/layers.py): not capturable
        # (and a step with an image's rows: the graphs embed token ids only)
        if (not step.decode_only or step.num_seqs > self.max_graph_batch or model.config.num_experts
                or step.embeds is not None):
            return None
        graphs = model.backend_state.get("decode_graphs")
        if graphs is None:
            from hearth.backend.graphs import DecodeGraphs

            max_blocks = -(-model.rope.max_positions // step.block_size)
            graphs = model.backend_state["decode_graphs"] = DecodeGraphs(
                self, model, kv_caches, self.max_graph_batch, max_blocks, step.block_size,
                capture=self.use_cuda_graphs)
        return graphs if graphs.fits(step) else None

    def inputs(self, model, step: StepInputs):
        dev = self.device
        meta = self.metadata(
            torch.from_numpy(step.slot_mapping).to(dev, non_blocking=True),
            torch.from_numpy(step.query_start_loc).to(dev, non_blocking=True),
            torch.from_numpy(step.seq_lens).to(dev, non_blocking=True),
            torch.from_numpy(step.block_tables).to(dev, non_blocking=True),
            step.block_size, int(step.query_lens.max()), model.config.num_kv_heads,
        )
        masks = row_masks(step)
        if masks is not None:
            spans, tree_start, tree_masks = (None if a is None else torch.from_numpy(a).to(dev, non_blocking=True)
                                             for a in masks)
            meta.masks = attention.RowMasks(spans, tree_start, tree_masks)
        return torch.as_tensor(step.input_ids, device=dev), torch.from_numpy(step.positions).to(dev), meta

    def metadata(self, slot_mapping, query_start_loc, seq_lens, block_tables, block_size: int, max_query_len: int,
                 num_kv_heads: int) -> GpuMetadata:
        splits = attention.choose_num_splits(len(seq_lens), num_kv_heads, block_tables.shape[1] * block_size,
                                             self._num_sms)
        return GpuMetadata(slot_mapping, query_start_loc, seq_lens, block_tables, block_size, max_query_len, splits)

    # ---- the model's operations --------------------------------------------------------

    def rms_norm(self, x, weight, eps, weight_offset=0.0, residual=None):
        return norm.rms_norm(x, weight, eps, weight_offset, residual)

    def rotary(self, cos, sin, positions, dtype):
        """The kernel reads the float32 tables at each position itself: no per-step gather (M-RoPE's tables are
        the step's own, gathered column by column: made row-major here)."""
        return positions, cos.contiguous(), sin.contiguous()

    def rope_and_store_kv(self, q, k, v, rotary, kv_cache, slot_mapping):
        positions, cos, sin = rotary
        return rope.rope_and_store_kv(q, k, v, positions, cos, sin, kv_cache[0], kv_cache[1], slot_mapping)

    def attention(self, q, k_cache, v_cache, meta: GpuMetadata, scale: float, softcap: float | None = None,
                  window: int | None = None, sinks=None):
        if meta.decode_only:
            return attention.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                              meta.block_size, num_splits=meta.num_splits, softcap=softcap,
                                              window=window, sinks=sinks)
        return attention.prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                           meta.seq_lens, scale, meta.block_size, meta.max_query_len, softcap=softcap,
                                           window=window, sinks=sinks, masks=meta.masks)

    def act_and_mul(self, gate, up, activation_name):
        return activation.act_and_mul(gate, up, activation_name)

    # ---- weights -----------------------------------------------------------------------

    def sparse_linear(self, module, threshold):
        raise ValueError("activation sparsity is not implemented on the gpu backend (no Triton kernel skips the "
                         "masked columns yet): use --backend cpu, or --backend reference for its quality alone")

    def stored_module(self, module, weight, dtype) -> nn.Module | None:
        """GGUF matrices in Q8_0, Q4_0, Q4_K, Q5_K, Q6_K stay in their blocks on the device, multiplied
        by Triton kernels; other GGUF types take the reference's tile-by-tile torch path; F16/BF16 become dense."""
        if not isinstance(module, nn.Embedding) and TritonQuantLinear.supports(weight):
            return TritonQuantLinear(weight, module.bias, self.device)
        return super().stored_module(module, weight, dtype)


def row_masks(step: StepInputs) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None:
    """The prefill kernel's attention.RowMasks of a step with images that attend both ways or token trees, as
    host arrays (None: every row causal). As the reference's masks (base.py: AttentionMetadata.from_step):
    a row of an image sees the whole image (what of it the cache holds by the step's end); the rows of a
    sequence with at most MAX_DECODE_QUERY_LEN new ones and no image see through their tree masks, at their
    depth's position (the others' tree region starts at their end: none)."""
    trees = step.tree_masks is not None
    if step.image_blocks is None and not trees:
        return None
    lens, seq_lens = step.query_lens, step.seq_lens.astype(np.int64)
    seq_of_row = np.repeat(np.arange(step.num_seqs), lens)
    positions = (seq_lens - lens)[seq_of_row] + np.arange(len(seq_of_row)) - step.query_start_loc[seq_of_row]
    ends = positions + 1
    images = np.zeros((0, 3), np.int64) if step.image_blocks is None else step.image_blocks
    for s, low, high in images.tolist():
        ends[(seq_of_row == s) & (positions >= low) & (positions < high)] = min(high, seq_lens[s])
    tree_start = tree_masks = None
    if trees:
        in_tree = lens <= MAX_DECODE_QUERY_LEN
        in_tree[images[:, 0]] = False
        tree_start = np.where(in_tree, step.tree_start, seq_lens).astype(np.int32)
        tree_masks = np.ascontiguousarray(step.tree_masks, dtype=np.int64)
        depths = np.unpackbits(tree_masks.view(np.uint8)).reshape(-1, 64).sum(1)
        rows = in_tree[seq_of_row]
        positions = np.where(rows, tree_start[seq_of_row] + depths - 1, positions)
        ends = np.where(rows, seq_lens[seq_of_row], ends)
    return np.stack([positions, ends], axis=1).astype(np.int32), tree_start, tree_masks
