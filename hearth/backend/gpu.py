"""The GPU backend: Triton kernels for every operation, CUDA graphs for decode steps, GGUF
weights kept quantized on the device.

Attention metadata is one varlen description of the step (hearth/triton_kernels/attention.py):
sequence start offsets, context lengths, block tables, slot mapping; a step of decodes only runs
the split-KV decode kernel, any other step the paged prefill kernel (a decode being a sequence
with one query row), which also takes the rows that see other keys than causal ones (`row_masks`:
images both ways, speculative token trees); attention sinks (gpt-oss) go to both kernels. Multi-head
latent attention (a V narrower than K, the first columns of its rows)
runs hearth/triton_kernels/latent_attention.py's pair instead. Each layer's kernels take its own
cache's shape, and the decode kernel's split count is chosen for its programs per sequence
(GpuMetadata.num_splits). Decode steps up to the largest captured batch replay a CUDA graph
(graphs.py). The KV cache may be the compute dtype, q8_0 or fp8 e4m3 (hearth/kv_format.py):
the RoPE + cache-write kernel quantizes, the attention kernels dequantize as they load. A hybrid
model's state layers run hearth/triton_kernels/state_ops.py's kernels on the step's state rows
(`GpuMetadata.state`: each sequence's slot, from StepInputs or, in a decode graph, from the slots
buffer of decode_inputs.py), so its decode steps are captured as any model's. The same
code runs on a CPU under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check it
without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hearth.backend.base import Backend, DecodeSampling, StepInputs, apply_rope
from hearth.backend.gpu_linear import TritonQuantLinear
from hearth.config import MAX_DECODE_QUERY_LEN
from hearth.triton_kernels import activation, attention, latent_attention, norm, rope, state_ops

FP8_CAPABILITY = (8, 9)  # the first GPUs with e4m3 conversions (Ada)


@dataclass
class GpuMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token (< 0: padding, not stored)
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S] context after this step
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    block_size: int
    max_query_len: int  # host int: the prefill kernel's grid
    num_sms: int  # the GPU's streaming multiprocessors, which the decode kernels' splits aim to fill
    state: state_ops.StateRows | None = None  # a hybrid model's: each sequence's state rows
    masks: attention.RowMasks | None = None  # rows that see other keys than causal ones (images, token trees)
    # the same for layers without a window where images attend both ways on sliding layers only (Gemma 4's)
    full_layer_masks: attention.RowMasks | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1 and self.masks is None

    def num_splits(self, programs: int) -> int:
        """Split-KV parts of a decode kernel that runs `programs` programs per sequence and split (a layer's
        KV heads; each layer's own where their K/V differ in shape). From host values and shapes only, so fixed
        per captured graph."""
        return attention.choose_num_splits(len(self.seq_lens), programs, self.block_tables.shape[1] * self.block_size,
                                           self.num_sms)


class GpuBackend(Backend):
    name = "gpu"

    def __init__(self, device: torch.device | str, use_cuda_graphs: bool = True, max_graph_batch: int = 256):
        super().__init__(device)
        self.use_cuda_graphs = use_cuda_graphs
        self.max_graph_batch = max_graph_batch
        self._num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                         if self.device.type == "cuda" else 132)
        # (major, minor); None under Triton's interpreter, which converts fp8 in software
        self.capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None

    @property
    def weights_on_device(self) -> bool:
        return True  # (also under Triton's interpreter on a CPU: the tests run the GPU's path, copies and all)

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
        config = model.config
        if (not step.decode_only or step.num_seqs > self.max_graph_batch or step.embeds is not None
                or any(config.is_moe_layer(layer) for layer in range(config.num_layers))):
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
            step.block_size, int(step.query_lens.max()),
            None if step.state_slots is None else torch.from_numpy(step.state_slots).to(dev, non_blocking=True),
            None if step.state_snapshots is None else torch.from_numpy(step.state_snapshots).to(dev, non_blocking=True),
        )
        meta.masks = meta.full_layer_masks = self._row_masks(step, images=True)
        if step.image_blocks_sliding_only:
            meta.full_layer_masks = self._row_masks(step, images=False)
        return torch.as_tensor(step.input_ids, device=dev), torch.from_numpy(step.positions).to(dev), meta

    def metadata(self, slot_mapping, query_start_loc, seq_lens, block_tables, block_size: int, max_query_len: int,
                 state_slots: torch.Tensor | None = None, state_snapshots: torch.Tensor | None = None) -> GpuMetadata:
        """state_slots [S] (a hybrid model: each sequence's state row) and state_snapshots [S] (verifying
        guesses: the first of its snapshot rows, -1 none), or None."""
        state = None if state_slots is None else state_ops.StateRows(state_slots, query_start_loc, seq_lens,
                                                                     max_query_len, state_snapshots)
        return GpuMetadata(slot_mapping, query_start_loc, seq_lens, block_tables, block_size, max_query_len,
                           self._num_sms, state)

    def takes_token_trees(self, config) -> bool:
        return not config.kv_lora_rank  # the latent attention kernels are causal only

    def _row_masks(self, step: StepInputs, images: bool) -> attention.RowMasks | None:
        masks = row_masks(step, images)
        if masks is None:
            return None
        return attention.RowMasks(*(None if a is None else torch.from_numpy(a).to(self.device, non_blocking=True)
                                    for a in masks))

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

    def rope(self, q, rotary):
        """q alone (a layer over an earlier layer's cache: gemma4's), in float32 as the kernel rotates."""
        positions, cos, sin = rotary
        return apply_rope(q.float(), (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))).to(q.dtype)

    def attention(self, q, k_cache, v_cache, meta: GpuMetadata, scale: float, softcap: float | None = None,
                  window: int | None = None, sinks=None):
        if v_cache.shape[-1] != k_cache.shape[-1]:  # V, the first columns of K's rows: multi-head latent attention
            return self._latent_attention(q, k_cache, v_cache, meta, scale)
        if meta.decode_only:
            return attention.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                              meta.block_size, num_splits=meta.num_splits(k_cache.shape[1]),
                                              softcap=softcap, window=window, sinks=sinks)
        return attention.prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                           meta.seq_lens, scale, meta.block_size, meta.max_query_len, softcap=softcap,
                                           window=window, sinks=sinks,
                                           masks=meta.masks if window is not None else meta.full_layer_masks)

    def _latent_attention(self, q, cache, latent, meta: GpuMetadata, scale: float):
        """q [T, heads, rank + rope] against one latent cache [slots, 1, rank + rope] whose first rank columns
        (`latent`, a view) are the values (hearth/triton_kernels/latent_attention.py) -> [T, heads, rank]."""
        assert latent.data_ptr() == cache.data_ptr() and latent.stride() == cache.stride(), "a view of the cache"
        if meta.masks is not None:
            raise ValueError("the gpu backend's latent attention kernels are causal only: no token trees")
        rank = latent.shape[-1]
        if meta.decode_only:
            splits = meta.num_splits(latent_attention.decode_programs(q.shape[1]))
            return latent_attention.decode_attention(q, cache, rank, meta.block_tables, meta.seq_lens, scale,
                                                     meta.block_size, splits)
        return latent_attention.prefill_attention(q, cache, rank, meta.block_tables, meta.query_start_loc,
                                                  meta.seq_lens, scale, meta.block_size, meta.max_query_len)

    def act_and_mul(self, gate, up, activation_name):
        return activation.act_and_mul(gate, up, activation_name)

    # the state layers' operations: every sequence of the step in one launch or two, from device tensors only

    def causal_conv1d(self, x, state, weight, bias, meta: state_ops.StateRows, activation=None):
        return state_ops.causal_conv1d(x, state, weight, bias, meta, activation)

    def gated_delta_rule(self, q, k, v, g, beta, state, meta: state_ops.StateRows):
        return state_ops.gated_delta_rule(q, k, v, g, beta, state, meta)

    def ssm_scan(self, q, k, v, g, state, meta: state_ops.StateRows):
        return state_ops.ssm_scan(q, k, v, g, state, meta)

    # ---- weights -----------------------------------------------------------------------

    def sparse_linear(self, module, threshold):
        raise ValueError("activation sparsity is not implemented on the gpu backend (no Triton kernel skips the "
                         "masked columns yet): use --backend cpu, or --backend reference for its quality alone")

    def stored_module(self, module, weight, dtype) -> nn.Module | None:
        """GGUF matrices in Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K stay in their blocks on the device, multiplied
        by Triton kernels; other GGUF types take the reference's tile-by-tile torch path; F16/BF16 become dense."""
        if not isinstance(module, nn.Embedding) and TritonQuantLinear.supports(weight):
            return TritonQuantLinear(weight, module.bias, self.device)
        return super().stored_module(module, weight, dtype)


def row_masks(step: StepInputs, images: bool = True) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None:
    """The prefill kernel's attention.RowMasks of a step with images that attend both ways (unless `images` is
    False) or token trees, as host arrays (None: every row causal). As the reference's masks (base.py:
    AttentionMetadata.from_step): a row of an image sees the whole image (what of it the cache holds by the
    step's end); the rows of a sequence with at most MAX_DECODE_QUERY_LEN new ones and no image see through
    their tree masks, at their depth's position (the others' tree region starts at their end: none)."""
    trees = step.tree_masks is not None
    no_images = np.zeros((0, 3), np.int64)
    step_images = no_images if step.image_blocks is None else step.image_blocks
    both_ways = step_images if images else no_images
    if not len(both_ways) and not trees:
        return None
    lens, seq_lens = step.query_lens, step.seq_lens.astype(np.int64)
    seq_of_row = np.repeat(np.arange(step.num_seqs), lens)
    positions = (seq_lens - lens)[seq_of_row] + np.arange(len(seq_of_row)) - step.query_start_loc[seq_of_row]
    ends = positions + 1
    for s, low, high in both_ways.tolist():
        ends[(seq_of_row == s) & (positions >= low) & (positions < high)] = min(high, seq_lens[s])
    tree_start = tree_masks = None
    if trees:
        in_tree = lens <= MAX_DECODE_QUERY_LEN
        in_tree[step_images[:, 0]] = False
        tree_start = np.where(in_tree, step.tree_start, seq_lens).astype(np.int32)
        tree_masks = np.ascontiguousarray(step.tree_masks, dtype=np.int64)
        depths = np.unpackbits(tree_masks.view(np.uint8)).reshape(-1, 64).sum(1)
        rows = in_tree[seq_of_row]
        positions = np.where(rows, tree_start[seq_of_row] + depths - 1, positions)
        ends = np.where(rows, seq_lens[seq_of_row], ends)
    return np.stack([positions, ends], axis=1).astype(np.int32), tree_start, tree_masks
